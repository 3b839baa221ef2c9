"""Builders for tests: tiny seeded encoders and patches with known, distinct values."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from transformers import BertTokenizerFast

from patchserve.local import free_port, patchserve_process, served, start_redis, wait_ready
from patchserve.patches.synthetic import random_bert
from patchserve.patches.synthetic import random_patch as make_patch

__all__ = ["free_port", "make_patch", "patchserve_process", "served", "start_redis", "wait_ready"]

WORDS = [
    "the",
    "a",
    "an",
    "is",
    "was",
    "good",
    "bad",
    "great",
    "awful",
    "movie",
    "film",
    "plot",
    "actor",
    "fun",
    "boring",
    "love",
    "hate",
    "what",
    "who",
    "where",
    "when",
    "why",
    "how",
    "city",
    "name",
    "person",
    "number",
    "big",
    "small",
    "red",
    "blue",
    "cat",
    "dog",
    "runs",
    "quickly",
    "slowly",
    "and",
    "or",
    "not",
    "very",
    "really",
]


def tiny_vocab() -> list[str]:
    """Special tokens, whole words, single letters and ``##`` letter pieces (unknown words split into pieces)."""
    letters = list("abcdefghijklmnopqrstuvwxyz")
    return list(
        dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *(f"##{c}" for c in letters)])
    )


def tiny_bert_settings(**overrides: object) -> dict[str, object]:
    """The tiny BERT's configuration (``BertConfig`` fields), with ``overrides``."""
    cfg: dict[str, object] = {
        "vocab_size": len(tiny_vocab()),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "type_vocab_size": 2,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
    }
    return cfg | overrides


def make_tiny_bert_folder(folder: Path, seed: int = 0, **config: object) -> Path:
    """A random BERT (2 layers, hidden 32, or what ``config`` overrides) with a real WordPiece tokenizer over the
    tiny vocabulary, saved as an HF folder."""
    vocab = tiny_vocab()
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True)
    assert tokenizer.tokenize("the good movie") == ["the", "good", "movie"], "tokenizer lost its vocabulary"
    return random_bert(folder, tokenizer, seed=seed, **tiny_bert_settings(**config))


def synthetic_rows(kind: str, n: int, seed: int = 0) -> list[dict]:
    """A learnable task in the tiny vocabulary: the label is carried by one cue word among random filler."""
    rng = random.Random(seed)
    filler = ["the", "a", "movie", "film", "plot", "actor", "city", "cat", "dog", "runs", "and", "very"]
    rows = []
    for _ in range(n):
        words = [rng.choice(filler) for _ in range(rng.randint(3, 8))]
        positive = rng.random() < 0.5
        words.insert(rng.randrange(len(words) + 1), "good" if positive else "bad")
        text = " ".join(words)
        if kind == "classification":
            rows.append({"text": text, "label": "positive" if positive else "negative"})
        elif kind == "pair":
            rows.append({"text": text, "text_pair": rng.choice(filler), "label": "yes" if positive else "no"})
        elif kind == "regression":
            rows.append({"text": text, "text_pair": "the film", "label": 4.5 if positive else 0.5})
        elif kind == "ner":  # BIO entities: "good film" is a POS entity of two words, "bad" alone a NEG one
            toks = text.replace("good", "good film").split()
            tags = ["O"] * len(toks)
            for i, t in enumerate(toks):
                if t in ("good", "bad"):
                    tags[i] = "B-POS" if t == "good" else "B-NEG"
                    if t == "good":
                        tags[i + 1] = "I-POS"
            rows.append({"tokens": toks, "tags": tags})
        else:  # token-classification: cue words are ADJ, the rest OTHER
            toks = text.split()
            rows.append({"tokens": toks, "tags": ["ADJ" if t in ("good", "bad") else "OTHER" for t in toks]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def wait_until(pred, timeout: float = 20.0, what: str = "condition", interval: float = 0.01) -> None:
    """Poll ``pred()`` every ``interval`` seconds until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def retired_patch(encoder, task: str = "sentiment", seed: int = 1):
    """A ``bitfit-ln`` patch as an earlier release wrote it (biases, every LayerNorm's gain, a head; patch type
    "bitfit-ln", which this build no longer serves), as the object a registry's ``put`` takes: its bytes, content
    hash and task."""
    import hashlib
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save

    patch = make_patch(encoder, task, seed=seed)
    gains = {
        f"scale.{name}.weight": module.weight.detach().float() + 0.1
        for name, module in encoder.model.named_modules()
        if isinstance(module, torch.nn.LayerNorm)
    }
    tensors = {f"bias.{n}": v for n, v in patch.biases.items()} | gains
    tensors |= {"head.weight": patch.head_weight, "head.bias": patch.head_bias}
    meta = json.loads(patch.meta.to_json()) | {"patch_type": "bitfit-ln"}
    data = save(tensors, metadata={"patchserve": json.dumps(meta, sort_keys=True, separators=(",", ":"))})
    patch_id = "sha256:" + hashlib.sha256(data).hexdigest()
    return SimpleNamespace(data=data, patch_id=patch_id, meta=SimpleNamespace(task=task))


def training_data(tmp_path: Path, kind: str, n_train: int = 240, n_dev: int = 60):
    """A learnable synthetic task of ``kind``: (train, dev) datasets of seeded rows, written as JSONL and read back."""
    from patchserve.patches.data import load_dataset

    train = load_dataset(write_jsonl(tmp_path / f"{kind}-train.jsonl", synthetic_rows(kind, n_train, seed=1)))
    dev = load_dataset(
        write_jsonl(tmp_path / f"{kind}-dev.jsonl", synthetic_rows(kind, n_dev, seed=2)),
        kind=train.kind,
        labels=train.labels or None,
    )
    return train, dev


def train_config(**kw):
    """A TrainConfig for a quick CPU run on ``training_data``: ``kw`` override the settings."""
    from patchserve.patches.train_config import TrainConfig

    base = {
        "task": "t",
        "min_steps": 60,
        "epochs": 1,
        "batch_size": 16,
        "eval_every": 20,
        "device": "cpu",
        "patience": 100,
        "lr": 1e-2,
        "pooling": "mean",
        "restarts": 1,  # one seed unless a test is about restarts (small data would get 3)
        "checkpoint": "best",  # these dev sets are tiny: by default they would keep the last checkpoint
    }
    return TrainConfig(**(base | kw))


def name_vector(encoder, name: str):
    """The encoder's mean-pooled unit vector of one text, encoded alone (no padding)."""
    import torch

    enc = encoder.tokenizer(name, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder.model.eval()(**enc).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=-1)
