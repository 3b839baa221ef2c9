"""Turning request inputs into runner rows, and runner outputs into predictions, for each kind of patch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from patches.format import Patch
from server.engine.runner import Row
from server.schemas import LabelScore, PairInput, Prediction, TokenPrediction


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


def encode(tokenizer: Any, patch: Patch, texts: list[str], pairs: list[str] | None, max_len: int) -> list[Encoded]:
    """Tokenise for ``patch``'s kind; inputs longer than ``max_len`` tokens are truncated and flagged."""
    if patch.meta.kind == "token-classification":
        if pairs is not None:
            raise InputError(f"task {patch.meta.task!r} tags tokens of one text; it takes no text_pair")
        return [_encode_words(tokenizer, patch, text, max_len) for text in texts]
    full = tokenizer(texts, pairs, truncation=False, verbose=False)
    long = [i for i, ids in enumerate(full["input_ids"]) if len(ids) > max_len]
    if long:
        cut = tokenizer(
            [texts[i] for i in long],
            None if pairs is None else [pairs[i] for i in long],
            truncation=True,
            max_length=max_len,
        )
        for j, i in enumerate(long):
            full["input_ids"][i] = cut["input_ids"][j]
            if "token_type_ids" in full:
                full["token_type_ids"][i] = cut["token_type_ids"][j]
    out, cut_rows = [], set(long)
    for i, ids in enumerate(full["input_ids"]):
        types = full["token_type_ids"][i] if "token_type_ids" in full else [0] * len(ids)
        out.append(Encoded(Row(list(ids), list(types), patch), truncated=i in cut_rows))
    return out


def _encode_words(tokenizer: Any, patch: Patch, text: str, max_len: int) -> Encoded:
    words = text.split()
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
    return Encoded(row, truncated=len(kept) < len(words), words=words[: len(kept)], first_subword=kept)


def decode(out: torch.Tensor, enc: Encoded, top_k: int | None, all_scores: bool) -> Prediction:
    """A runner output (logits) -> the prediction for its kind."""
    meta = enc.row.patch.meta
    if meta.kind == "regression":
        return Prediction(value=float(out[0]), truncated=enc.truncated)
    if meta.kind == "token-classification":
        assert enc.words is not None and enc.first_subword is not None
        probs = out[enc.first_subword].softmax(-1)  # [n_words, C]
        best = probs.max(-1)
        tokens = [
            TokenPrediction(token=w, label=meta.labels[int(i)], score=float(p))
            for w, p, i in zip(enc.words, best.values, best.indices, strict=True)
        ]
        return Prediction(tokens=tokens, truncated=enc.truncated)
    probs = out.softmax(-1)
    top = int(probs.argmax())
    pred = Prediction(label=meta.labels[top], score=float(probs[top]), truncated=enc.truncated)
    if top_k is not None:
        vals, idx = probs.topk(min(top_k, len(meta.labels)))
        pred.top_k = [LabelScore(label=meta.labels[int(i)], score=float(v)) for v, i in zip(vals, idx, strict=True)]
    if all_scores:
        pred.scores = {label: float(p) for label, p in zip(meta.labels, probs, strict=True)}
    return pred
