"""Turning request inputs into runner rows, and runner outputs into predictions, for each kind of patch."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from patchserve.patches.api import LabelScore, PairInput, Prediction, TokenPrediction
from patchserve.patches.format import Patch
from patchserve.server.engine.protocol import Row


class InputError(ValueError):
    """The request's inputs do not fit the task (HTTP 422)."""


@dataclass
class Encoded:
    row: Row
    truncated: bool
    words: list[str] | None = None  # tagging: the input's words
    first_subword: list[int] | None = None  # tagging: token position of each kept word


def normalise_inputs(inputs: str | list[str] | list[PairInput]) -> tuple[list[str], list[str] | None]:
    """(texts, pairs or None) from any accepted input form."""
    if isinstance(inputs, str):
        return [inputs], None
    if not inputs:
        raise InputError("inputs is empty: send a text or a non-empty list")
    if all(isinstance(x, str) for x in inputs):
        return [str(x) for x in inputs], None
    pairs = [x for x in inputs if isinstance(x, PairInput)]
    if len(pairs) != len(inputs):
        raise InputError("inputs mixes plain texts and {text, text_pair} objects; use one form per request")
    if all(p.text_pair is None for p in pairs):
        return [p.text for p in pairs], None
    if any(p.text_pair is None for p in pairs):
        raise InputError("some inputs have text_pair and some do not; a request is all pairs or all single texts")
    return [p.text for p in pairs], [str(p.text_pair) for p in pairs]


def check_request(patch: Patch, pairs: list[str] | None, top_k: int | None = None, all_scores: bool = False) -> None:
    """Refuse what this task cannot do instead of silently doing something else (422)."""
    meta = patch.meta
    if pairs is not None and (meta.kind == "token-classification" or meta.text_pair is False):
        what = "tags the words of one text" if meta.kind == "token-classification" else "reads single texts"
        raise InputError(
            f"task {meta.task!r} {what} (it was trained without text_pair); send plain texts without text_pair"
        )
    if pairs is None and meta.text_pair is True:
        raise InputError(
            f'task {meta.task!r} scores sentence pairs: send inputs as [{{"text": ..., "text_pair": ...}}, ...]'
        )
    if (top_k is not None or all_scores) and meta.kind != "classification":
        raise InputError(f"top_k and all_scores apply to classification; task {meta.task!r} is {meta.kind}")


def encode(
    tokenizer: Any,
    patch: Patch | None,
    texts: list[str],
    pairs: list[str] | None,
    max_len: int,
    max_chars: int,
    output: str = "logits",
) -> list[Encoded]:
    """Rows for ``patch`` (None: the base encoder) and ``output`` (``logits`` or ``embedding``), with bounded work:
    texts are cut to ``max_chars`` characters first, then truncated to ``max_len`` tokens while tokenising; a row
    that lost anything is flagged ``truncated``. A tagging task's logits are per word. CPU-bound: call it from a
    worker thread."""
    cut = [len(t) > max_chars or (pairs is not None and len(pairs[i]) > max_chars) for i, t in enumerate(texts)]
    texts = [t[:max_chars] for t in texts]
    pairs = None if pairs is None else [p[:max_chars] for p in pairs]
    if output == "logits" and patch is not None and patch.meta.kind == "token-classification":
        return [
            _encode_words(tokenizer, patch, text, max_len, was_cut) for text, was_cut in zip(texts, cut, strict=True)
        ]
    backend = truncating_backend(tokenizer, max_len)
    if backend is not None:  # a fast tokenizer: its Rust core in one call, which records what truncation removed
        encodings = backend.encode_batch(texts if pairs is None else list(zip(texts, pairs, strict=True)))
        uses_types = "token_type_ids" in tokenizer.model_input_names
        return [
            Encoded(
                Row(e.ids, e.type_ids if uses_types else [0] * len(e.ids), patch, output),
                truncated=was_cut or bool(e.overflowing),
            )
            for e, was_cut in zip(encodings, cut, strict=True)
        ]
    # a slow tokenizer does not record what truncation removed: count the whole (character-capped, so bounded) inputs
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_len, verbose=False)
    full = tokenizer(texts, pairs, truncation=False, verbose=False)["input_ids"]
    out = []
    for i, ids in enumerate(enc["input_ids"]):
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(ids)
        out.append(Encoded(Row(list(ids), list(types), patch, output), truncated=cut[i] or len(full[i]) > max_len))
    return out


# a fast tokenizer's Rust core, copied once per truncation length (a task's max_seq_length), so that a request calls
# it directly: the Hugging Face wrapper around it costs about as much again as the tokenizing of a short text, and it
# sets the shared core's truncation on every call
_TRUNCATING: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_MAX_LENGTHS = 16  # distinct truncation lengths kept per tokenizer (tasks rarely use more than one or two)


def truncating_backend(tokenizer: Any, max_len: int) -> Any | None:
    """The Rust tokenizer behind ``tokenizer`` (None for a slow one) set to truncate as ``tokenizer(...,
    truncation=True, max_length=max_len)`` does (longest first, on the tokenizer's truncation side) and not to pad:
    ``encode_batch`` then gives the same ids and token types. A copy of its own, never changed once made, so threads
    may share it."""
    core = getattr(tokenizer, "backend_tokenizer", None)
    if core is None or not getattr(tokenizer, "is_fast", False):
        return None
    by_len = _TRUNCATING.setdefault(tokenizer, {})
    backend = by_len.get(max_len)
    if backend is None:
        backend = type(core).from_str(core.to_str())
        backend.enable_truncation(max_len, stride=0, strategy="longest_first", direction=tokenizer.truncation_side)
        backend.no_padding()
        if len(by_len) >= _MAX_LENGTHS:
            by_len.clear()
        by_len[max_len] = backend
    return backend


def serial_tokenizers() -> None:
    """Make ``encode`` tokenize on the calling thread: the server's entry points call it (``patchserve serve``, whose
    front ends inherit it, and ``app_factory``); an explicit TOKENIZERS_PARALLELISM wins. A request's few texts are
    not worth the Rust tokenizer's thread pool: on 2 busy cores, 8 real sentences took 1.0 ms of wall time through
    the pool against 0.48 ms on the calling thread, at 1.3x the CPU, and over HTTP a front end spent 8% more CPU a
    request at 8 inputs with it (docs/experiments.md). A front end is one core's worth of work beside the others
    anyway."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _encode_words(tokenizer: Any, patch: Patch, text: str, max_len: int, was_cut: bool) -> Encoded:
    words = text.split()
    if was_cut and len(words) > 1 and not text[-1].isspace():
        words = words[:-1]  # the character cap split the last word: tag only whole words
    if not words:
        raise InputError("an input of a token-classification task has no words")
    enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
    first: dict[int, int] = {}
    for pos, w in enumerate(enc.word_ids()):
        if w is not None and w not in first:
            first[w] = pos
    kept = [first[w] for w in range(len(words)) if w in first]
    types = enc.get("token_type_ids") or [0] * len(enc["input_ids"])
    row = Row(list(enc["input_ids"]), list(types), patch)
    return Encoded(row, truncated=was_cut or len(kept) < len(words), words=words[: len(kept)], first_subword=kept)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def decode(out: np.ndarray, enc: Encoded, top_k: int | None, all_scores: bool) -> Prediction:
    """An engine output (float32 logits) -> the prediction for its kind."""
    assert enc.row.patch is not None, "predictions come from task rows"
    meta = enc.row.patch.meta
    if meta.kind == "regression":
        return Prediction(value=float(out[0]), truncated=enc.truncated)
    if meta.kind == "token-classification":
        assert enc.words is not None and enc.first_subword is not None
        probs = _softmax(out[enc.first_subword])  # [n_words, C]
        best = probs.argmax(-1)
        tokens = [
            TokenPrediction(token=w, label=meta.labels[int(i)], score=float(p[i]))
            for w, p, i in zip(enc.words, probs, best, strict=True)
        ]
        return Prediction(tokens=tokens, truncated=enc.truncated)
    probs = _softmax(out)
    top = int(probs.argmax())
    pred = Prediction(label=meta.labels[top], score=float(probs[top]), truncated=enc.truncated)
    if top_k is not None:
        best_first = np.argsort(-probs, kind="stable")[: min(top_k, len(meta.labels))]
        pred.top_k = [LabelScore(label=meta.labels[int(i)], score=float(probs[i])) for i in best_first]
    if all_scores:
        pred.scores = {str(label): float(p) for label, p in zip(meta.labels, probs, strict=True)}
    return pred
