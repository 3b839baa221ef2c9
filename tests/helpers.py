"""Builders for tests: tiny seeded encoders and patches with known, distinct values."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from patches.bitfit import base_biases, target_names
from patches.encoder import Encoder
from patches.format import BaseRef, Patch, PatchMeta

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


def tiny_bert_config(**overrides: object) -> BertConfig:
    cfg = {
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
    cfg.update(overrides)
    return BertConfig(**cfg)


def make_tiny_bert_folder(folder: Path, seed: int = 0, **config: object) -> Path:
    """A random BERT (2 layers, hidden 32, or what ``config`` overrides) with a real WordPiece tokenizer over the
    tiny vocabulary, saved as an HF folder."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True)
    assert tokenizer.tokenize("the good movie") == ["the", "good", "movie"], "tokenizer lost its vocabulary"
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    model = BertModel(tiny_bert_config(**config))
    with torch.no_grad():  # make biases non-zero so that dropping/folding them is really exercised
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def make_patch(
    encoder: Encoder,
    task: str = "sentiment",
    *,
    kind: str = "classification",
    labels: list[str] | None = None,
    subset: str = "all",
    pooling: str = "mean",
    seed: int = 1,
    scale: float = 0.5,
    head_scale: float = 1.0,
) -> Patch:
    """A patch whose biases are the base values moved by seeded noise, with a seeded random head (its weights
    times ``head_scale``: below 1, class scores stay away from 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    if labels is None:
        labels = {
            "classification": ["negative", "positive"],
            "regression": [],
            "token-classification": ["DET", "NOUN", "VERB"],
        }[kind]
    names = target_names(encoder.model, subset)
    biases = {n: b + scale * torch.randn(b.shape, generator=gen) for n, b in base_biases(encoder.model, names).items()}
    n_out = 1 if kind == "regression" else len(labels)
    meta = PatchMeta(
        task=task,
        kind=kind,
        labels=labels,
        base=BaseRef(encoder.name, encoder.fingerprint),
        bias_subset=subset,
        pooling=pooling,
        max_seq_length=32,
        metrics={"dev_accuracy": 0.5},
    )
    return Patch(
        meta=meta,
        biases=biases,
        head_weight=head_scale * torch.randn(n_out, encoder.hidden_size, generator=gen),
        head_bias=torch.randn(n_out, generator=gen),
    )


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path, *options: str, password: str | None = None) -> tuple[subprocess.Popen, str]:
    """A real, throwaway redis-server on a free port (never fakeredis), with extra ``options`` such as
    ``"--maxmemory", "1"`` and an optional ``password`` (requirepass, and in the URL); returns the process (the
    caller stops it) and its URL once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does this)")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir)]
    if password is not None:
        args += ["--requirepass", password]
    proc = subprocess.Popen(
        [*args, *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://{'' if password is None else f':{password}@'}127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                return proc, url
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def patchserve_process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``patchserve ARGS`` as a real process (its own process group, output to ``log``); stopped on exit with
    SIGTERM, then SIGKILL if it lingers."""
    exe = shutil.which("patchserve")
    assert exe, "patchserve console script not installed"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [exe, *args],
            env=dict(os.environ, PYTHONUNBUFFERED="1") | env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def wait_ready(base: str, timeout: float = 120.0) -> None:
    """Until ``base``/readyz answers 200 (a server process has loaded its encoder)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{base} did not become ready"
        time.sleep(0.1)


@contextlib.contextmanager
def served(folder: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    """A real ``patchserve serve`` process on a free port with ``env`` and extra ``args``, ready; yields its URL.
    Its output goes to ``folder``/server-PORT.log."""
    port = free_port()
    with patchserve_process(["serve", "--port", str(port), *args], env, folder / f"server-{port}.log"):
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        yield base
