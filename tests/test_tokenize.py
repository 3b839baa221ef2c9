"""The front end tokenizes through the fast tokenizer's Rust core directly (``server.predict.truncating_backend``):
it must give exactly the rows and truncation flags of the Hugging Face call it replaces, for any text, pair and
truncation length."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from patchserve.server.predict import encode, truncating_backend

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# texts a request can carry (no lone surrogates: JSON parsing refuses them before the tokenizer), with what
# tokenizers treat specially: accents, CJK, emoji, control characters, runs of spaces, special-token spellings
_texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=200) | st.sampled_from(
    ["", " ", "[CLS] [SEP] [PAD]", "naïve café ÉCOLE", "東京は晴れ", "a\u200bb\u00a0c", "😀 " * 40, "x" * 300]
)


def _hf(tokenizer, texts, pairs, max_len):
    """What ``encode`` did before: the Hugging Face call, and each row's overflow."""
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_len, verbose=False)
    types = enc["token_type_ids"] if "token_type_ids" in enc else [[0] * len(ids) for ids in enc["input_ids"]]
    return [
        (list(ids), list(t), bool(e.overflowing))
        for ids, t, e in zip(enc["input_ids"], types, enc.encodings, strict=True)
    ]


def _fast(tokenizer, texts, pairs, max_len):
    rows = encode(tokenizer, None, texts, pairs, max_len, max_chars=100_000)
    return [(e.row.input_ids, e.row.token_type_ids, e.truncated) for e in rows]


@pytest.fixture(scope="module", params=["tiny", "default"])
def tokenizer(request, tiny_encoder, minilm):
    return (tiny_encoder if request.param == "tiny" else minilm).tokenizer


@SETTINGS
@given(
    texts=st.lists(_texts, min_size=1, max_size=4),
    pair_texts=st.none() | st.lists(_texts, min_size=4, max_size=4),
    max_len=st.integers(8, 80),
)
@example(texts=["word " * 200], pair_texts=None, max_len=8)
@example(texts=["short", "word " * 100], pair_texts=["word " * 100, "x", "y", "z"], max_len=16)
def test_the_rust_core_gives_the_hugging_face_rows_and_truncation_flags(tokenizer, texts, pair_texts, max_len):
    pairs = None if pair_texts is None else pair_texts[: len(texts)]
    assert _fast(tokenizer, texts, pairs, max_len) == _hf(tokenizer, texts, pairs, max_len)


def test_one_truncating_copy_per_length_and_the_tokenizer_itself_untouched(minilm):
    tok = minilm.tokenizer
    before = tok.backend_tokenizer.truncation
    a, b = truncating_backend(tok, 16), truncating_backend(tok, 32)
    assert a is truncating_backend(tok, 16) and a is not b
    assert a is not tok.backend_tokenizer and a.truncation["max_length"] == 16 and a.padding is None
    assert tok.backend_tokenizer.truncation == before


def test_serve_tokenizes_serially_unless_told_otherwise():
    code = "import os; from patchserve.server.predict import serial_tokenizers; serial_tokenizers(); " + (
        "print(os.environ['TOKENIZERS_PARALLELISM'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "false"
    env["TOKENIZERS_PARALLELISM"] = "true"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "true"
