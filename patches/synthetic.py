"""Synthetic encoders and patches, for benchmarks, load tests and tests: a randomly initialised BERT saved as a
Hugging Face folder with a given tokenizer, and patches whose biases are an encoder's own moved by seeded noise.
They serve and train like real ones; nothing here is meant to predict anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from patchserve.patches.bitfit import base_biases, ia3_base, target_names
from patchserve.patches.encoder import Encoder
from patchserve.patches.format import (
    IA3_PATCH_TYPE,
    LORA_A,
    LORA_B,
    LORA_PATCH_TYPE,
    PATCH_TYPE,
    BaseRef,
    Patch,
    PatchMeta,
)
from patchserve.patches.lora import lora_shapes, targets_of
from patchserve.patches.train_config import DEFAULT_TARGETS
from patchserve.patches.validation import Label

DEFAULT_LABELS: dict[str, list[Label]] = {
    "classification": ["negative", "positive"],
    "regression": [],
    "token-classification": ["DET", "NOUN", "VERB"],
}


def random_bert(folder: Path, tokenizer: Any, *, seed: int = 0, bias_std: float = 0.5, **config: Any) -> Path:
    """A BERT of ``config`` (``transformers.BertConfig`` fields; the vocabulary is the tokenizer's) with seeded
    random weights, its biases drawn from N(0, ``bias_std``) so that dropping or folding one changes the outputs,
    saved with ``tokenizer`` as a Hugging Face folder."""
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(BertConfig(**{"vocab_size": len(tokenizer), **config}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, bias_std)
    model.save_pretrained(folder)
    return folder


def random_patch(
    encoder: Encoder,
    task: str = "sentiment",
    *,
    kind: str = "classification",
    labels: list[Label] | None = None,
    subset: str = "all",
    pooling: str = "mean",
    seed: int = 1,
    scale: float = 0.5,
    head_scale: float = 1.0,
    max_seq_length: int = 32,
    ia3_scale: float = 0.0,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS,
    lora_scale: float = 0.5,
) -> Patch:
    """A patch of ``encoder`` whose biases are the base values moved by seeded noise (std ``scale``), with a
    seeded random head (its weights times ``head_scale``: below 1, class scores stay away from 0 and 1).
    ``ia3_scale`` > 0 makes a ``bitfit-ia3`` patch: every (IA)^3 scale is 1 plus noise of that std. ``lora_rank`` > 0
    makes a ``lora`` patch of that rank on ``lora_targets``: A of std 1/sqrt(in), B of std ``lora_scale``."""
    gen = torch.Generator().manual_seed(seed)
    labels = DEFAULT_LABELS[kind] if labels is None else labels
    names = target_names(encoder.model, subset)
    biases = {n: b + scale * torch.randn(b.shape, generator=gen) for n, b in base_biases(encoder.model, names).items()}
    scales: dict[str, torch.Tensor] = {}
    if ia3_scale > 0:
        ones = ia3_base(encoder.model)
        scales = {n: v + ia3_scale * torch.randn(v.shape, generator=gen) for n, v in ones.items()}
    lora: dict[str, torch.Tensor] = {}
    if lora_rank > 0:
        shapes = lora_shapes(encoder.model)
        for module in targets_of(encoder.model, list(lora_targets)):
            out_f, in_f = shapes[module]
            lora[module + LORA_A] = torch.randn(lora_rank, in_f, generator=gen) / in_f**0.5
            lora[module + LORA_B] = lora_scale * torch.randn(out_f, lora_rank, generator=gen)
    n_out = 1 if kind == "regression" else len(labels)
    meta = PatchMeta(
        task=task,
        kind=kind,
        labels=labels,
        base=BaseRef(encoder.name, encoder.fingerprint),
        bias_subset=subset,
        pooling=pooling,
        max_seq_length=max_seq_length,
        metrics={"dev_accuracy": 0.5},
        patch_type=IA3_PATCH_TYPE if scales else LORA_PATCH_TYPE if lora else PATCH_TYPE,
    )
    return Patch(
        meta=meta,
        biases=biases,
        head_weight=head_scale * torch.randn(n_out, encoder.hidden_size, generator=gen),
        head_bias=torch.randn(n_out, generator=gen),
        scales=scales,
        lora=lora,
    )
