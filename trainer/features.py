"""A data set as the trainer feeds it: tokenised once (``featurize``), then padded into batches (``collate``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from patchserve.patches.data import Dataset
from patchserve.patches.packed_layout import to_device
from patchserve.patches.validation import Label

IGNORE = -100  # the label of a token that is not scored (a word's later sub-words, special tokens, padding)


@dataclass
class Features:
    input_ids: list[int]
    token_type_ids: list[int]
    label: int | float | list[int]


def featurize(tokenizer: Any, ds: Dataset, labels: Sequence[Label], max_len: int) -> list[Features]:
    """Tokenise a data set once. Tagging: the first sub-word of each word carries its tag, the rest are ignored.
    Labels are matched by their text, so a patch's "1" (as older patches stored every label) takes a file's 1."""
    index = {str(label): i for i, label in enumerate(labels)}
    if ds.kind == "token-classification":
        enc = tokenizer([e.tokens for e in ds.examples], is_split_into_words=True, truncation=True, max_length=max_len)
        feats = []
        for i, e in enumerate(ds.examples):
            tags, seen = [], set()
            for w in enc.word_ids(i):
                tags.append(IGNORE if w is None or w in seen else index[e.tags[w]])
                if w is not None:
                    seen.add(w)
            types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(tags)
            feats.append(Features(enc["input_ids"][i], types, tags))
        return feats
    pairs = [e.text_pair for e in ds.examples] if ds.is_pair else None
    enc = tokenizer([e.text for e in ds.examples], pairs, truncation=True, max_length=max_len)
    out = []
    for i, e in enumerate(ds.examples):
        label: int | float = float(e.label) if ds.kind == "regression" else index[str(e.label)]  # type: ignore[arg-type]
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(enc["input_ids"][i])
        out.append(Features(enc["input_ids"][i], types, label))
    return out


def collate(feats: list[Features], pad_id: int, kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``token_type_ids``, ``attention_mask`` ``[B, T]`` and ``labels`` (``[B]``, or
    ``[B, T]`` for tagging) on ``device``, copied without waiting for it (``to_device``); and each row's token count
    ``lengths`` ``[B]`` on the host."""
    n, t = len(feats), max(len(f.input_ids) for f in feats)
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    types = torch.zeros((n, t), dtype=torch.long)
    mask = torch.zeros((n, t), dtype=torch.long)
    for i, f in enumerate(feats):
        k = len(f.input_ids)
        ids[i, :k], types[i, :k], mask[i, :k] = torch.tensor(f.input_ids), torch.tensor(f.token_type_ids), 1
    if kind == "token-classification":
        labels = torch.full((n, t), IGNORE, dtype=torch.long)
        for i, f in enumerate(feats):
            labels[i, : len(f.label)] = torch.tensor(f.label)  # type: ignore[arg-type]
    elif kind == "regression":
        labels = torch.tensor([float(f.label) for f in feats])  # type: ignore[arg-type]
    else:
        labels = torch.tensor([int(f.label) for f in feats])  # type: ignore[arg-type]
    return {
        "input_ids": to_device(ids, device),
        "token_type_ids": to_device(types, device),
        "attention_mask": to_device(mask, device),
        "labels": to_device(labels, device),
        "lengths": torch.tensor([len(f.input_ids) for f in feats]),  # on the host: the packed model's layout
    }
