"""Scoring: a model's metrics on featurised rows, and the frozen encoder's pooled vectors of texts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from patchserve.patches.encoder import Encoder
from patchserve.patches.model import TaskModel, pool
from patchserve.patches.validation import Label
from patchserve.trainer.features import IGNORE, Features, collate
from patchserve.trainer.metrics import classification_metrics, regression_metrics, tagging_metrics
from patchserve.trainer.progress import StopFn, TrainingStopped, never

if TYPE_CHECKING:
    from patchserve.trainer.models import RunModel


@contextlib.contextmanager
def eval_mode(model: nn.Module | RunModel) -> Iterator[None]:
    """``model`` in eval mode (dropout off) for the block; its previous mode is restored after, a stop included."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def unit_vectors(
    encoder: Encoder, texts: Sequence[str], pooling: str, max_len: int, batch_size: int = 64
) -> torch.Tensor:
    """The frozen encoder's pooled, L2-normalised vector of each of ``texts`` ([N, hidden] float32, on the CPU),
    encoded in eval mode on the device the encoder is on (its mode is restored after)."""
    model = encoder.model
    device = next(model.parameters()).device
    out = []
    with eval_mode(model):
        for i in range(0, len(texts), batch_size):
            enc = encoder.tokenizer(
                list(texts[i : i + batch_size]), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
            ).to(device)
            result = model(**enc)
            pooler = getattr(result, "pooler_output", None)
            pooled = pool(pooling, result.last_hidden_state, enc["attention_mask"], pooler)
            out.append(nn.functional.normalize(pooled.float(), dim=-1).cpu())
    return torch.cat(out)


def label_vectors(encoder: Encoder, labels: Sequence[Label], pooling: str, max_len: int) -> torch.Tensor:
    """The rows of a label-name head (``head_init="labels"``): ``unit_vectors`` of the labels' names, each read as
    text, lower-cased, underscores as spaces."""
    return unit_vectors(encoder, [str(label).replace("_", " ").lower() for label in labels], pooling, max_len)


def evaluate(
    model: TaskModel,
    feats: list[Features],
    pad_id: int,
    labels: Sequence[Label],
    batch_size: int = 64,
    should_stop: StopFn = never,
) -> dict[str, float]:
    """Metrics of a plain model on featurised data (eval mode; restores the previous mode); ``labels`` are the task's
    labels or tags, in head order. ``should_stop`` is asked between batches (a long dev set must not delay a stop);
    it raises TrainingStopped(0, 0) when it says so."""
    device = next(model.parameters()).device
    scores = _Scores(model.kind, 1)
    with eval_mode(model), torch.no_grad():
        for i in range(0, len(feats), batch_size):
            if should_stop():
                raise TrainingStopped(0, 0)
            b = collate(feats[i : i + batch_size], pad_id, model.kind, device)
            scores.add(model(b["input_ids"], b["attention_mask"], b["token_type_ids"]), b["labels"])
    return scores.metrics(labels)[0]


def evaluate_runs(
    model: RunModel,
    feats: list[Features],
    pad_id: int,
    labels: Sequence[Label],
    runs: Sequence[int],
    batch_size: int = 64,
    should_stop: StopFn = never,
) -> list[dict[str, float]]:
    """``evaluate`` for several runs of one RunModel at once (each batch of rows goes in once per run, in one
    forward). One metrics dict per run, in order."""
    k = len(runs)
    scores = _Scores(model.kind, k)
    with eval_mode(model), torch.no_grad():
        for i in range(0, len(feats), batch_size):
            if should_stop():
                raise TrainingStopped(0, 0)
            chunk = feats[i : i + batch_size]
            b = collate(chunk * k, pad_id, model.kind, model.device)
            run_of_row = torch.tensor([r for r in runs for _ in chunk], device=model.device)
            scores.add(model.logits(b, run_of_row), b["labels"])
    return scores.metrics(labels)


class _Scores:
    """Predictions and gold labels of ``k`` runs, gathered batch by batch (each batch holds every run's rows, run
    after run), then scored by the kind's metrics."""

    def __init__(self, kind: str, k: int) -> None:
        self.kind, self.k = kind, k
        self.preds: list[list[np.ndarray]] = [[] for _ in range(k)]
        self.golds: list[list[np.ndarray]] = [[] for _ in range(k)]

    def add(self, logits: torch.Tensor, gold: torch.Tensor) -> None:
        logits, gold_all = logits.float().cpu(), gold.cpu()
        n = logits.shape[0] // self.k
        for j in range(self.k):
            out, g = logits[j * n : (j + 1) * n], gold_all[j * n : (j + 1) * n].numpy()
            if self.kind == "regression":
                self.preds[j].append(out.squeeze(-1).numpy())
                self.golds[j].append(g)
            elif self.kind == "token-classification":  # one array per sentence: entities must not span two
                for row_pred, row_gold in zip(out.argmax(-1).numpy(), g, strict=True):
                    keep = row_gold != IGNORE
                    self.preds[j].append(row_pred[keep])
                    self.golds[j].append(row_gold[keep])
            else:
                self.preds[j].append(out.argmax(-1).numpy())
                self.golds[j].append(g)

    def metrics(self, labels: Sequence[Label]) -> list[dict[str, float]]:
        if self.kind == "token-classification":
            return [tagging_metrics(p, g, labels) for p, g in zip(self.preds, self.golds, strict=True)]
        score = regression_metrics if self.kind == "regression" else classification_metrics
        return [score(np.concatenate(p), np.concatenate(g)) for p, g in zip(self.preds, self.golds, strict=True)]
