"""What a user could run instead of a patch, measured by the quality benchmarks on the same rows as BitFit:

- ``logreg``: the floor. The frozen default encoder's mean-pooled unit vectors and scikit-learn's logistic
  regression, C chosen on the dev split (for few-sample runs the dev carved from the draw, as the trainer carves it).
  A regression pair set (STS-B) has no classifier to fit: its floor is the cosine of the two texts' vectors, no
  training at all, which is what the sentence encoder was trained to give. A tagging set's floor classifies each
  word's unit vector (the encoder's output at the word's first subword, the trainer's own rule) the same way,
  scored by token accuracy.
- ``setfit``: SetFit (contrastive tuning of the whole sentence-transformers body, then a logistic-regression head),
  from PyPI, with its default settings and the default encoder as its body. It has no use for a dev split, so it
  trains on every row of the draw. Needs the ``baselines`` extra (``pip install -e .[baselines]``).

Neither is a patch: SetFit tunes every weight of the body, so each task would need a body of its own.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression

from patchserve.patches.data import Dataset
from patchserve.patches.encoder import Encoder
from patchserve.patches.validation import Label
from patchserve.trainer.evaluation import unit_vectors
from patchserve.trainer.features import IGNORE, collate, featurize
from patchserve.trainer.metrics import spearman

# What each baseline is, as the tables show it in place of "settings that differ from today's defaults".
BASELINES = {
    "logreg": "frozen encoder, mean-pooled unit vectors, logistic regression with C chosen on dev",
    "setfit": "SetFit's defaults, trained on every row (dev included)",
}
C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
MAX_LENGTH = 128  # the trainer's default max_seq_length


@dataclass
class BaselineResult:
    test: float
    dev: float | None
    # what was chosen or used (C, library versions): recorded with the run
    settings: dict[str, Any] = field(default_factory=dict)


def embed(encoder: Encoder, texts: list[str], device: torch.device, batch_size: int = 64) -> np.ndarray:
    """The frozen encoder's mean-pooled, L2-normalised vectors of ``texts`` ([N, hidden] float32), on ``device``."""
    encoder.model.to(device)
    return unit_vectors(encoder, texts, "mean", MAX_LENGTH, batch_size).numpy()


def _texts(ds: Dataset) -> list[str]:
    if ds.is_pair:
        raise SystemExit(f"{ds.source}: the baselines take single-sentence classification only")
    return [e.text for e in ds.examples]


def _labels(ds: Dataset) -> list[str]:
    return [str(e.label) for e in ds.examples]


def _accuracy(predicted: Any, ds: Dataset) -> float:  # SetFit's predictions: label strings
    return float(np.mean([str(p) == gold for p, gold in zip(predicted, _labels(ds), strict=True)]))


def logreg(encoder: Encoder, train: Dataset, dev: Dataset, test: Dataset, device: torch.device) -> BaselineResult:
    """The frozen-encoder floor: logistic regression on mean-pooled unit vectors, C chosen on ``dev`` (the smallest
    C of the best dev accuracy), fit on ``train`` only; for a regression pair set, the vectors' cosine."""
    if train.kind == "regression" and train.is_pair:
        return BaselineResult(test=_cosine_spearman(encoder, test, device), dev=_cosine_spearman(encoder, dev, device))
    if train.kind == "token-classification":
        (x_train, y_train), (x_dev, y_dev), (x_test, y_test) = (
            word_vectors(encoder, ds, train.labels, device) for ds in (train, dev, test)
        )
    elif train.kind == "classification":
        x_train, x_dev, x_test = (embed(encoder, _texts(ds), device) for ds in (train, dev, test))
        y_train, y_dev, y_test = (np.array(_labels(ds)) for ds in (train, dev, test))
    else:
        raise SystemExit(f"{train.source}: the logistic-regression floor takes classification, tags or sentence pairs")
    fits = [LogisticRegression(C=c, max_iter=5000).fit(x_train, y_train) for c in C_GRID]
    dev_scores = [float(np.mean(fit.predict(x_dev) == y_dev)) for fit in fits]
    best = dev_scores.index(max(dev_scores))
    return BaselineResult(
        test=float(np.mean(fits[best].predict(x_test) == y_test)),
        dev=dev_scores[best],
        settings={"C": C_GRID[best], "scikit-learn": version("scikit-learn")},
    )


def word_vectors(
    encoder: Encoder, ds: Dataset, tags: Sequence[Label], device: torch.device, batch_size: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Each word of a tagging set as the frozen encoder's L2-normalised output at its first subword, the word a
    trained patch's head sees (``patchserve.trainer.features.featurize``'s rule; words past the trainer's 128 tokens
    are cut as it cuts them), and its tag's index in ``tags``: ([words, hidden] float32, [words])."""
    feats = featurize(encoder.tokenizer, ds, tags, MAX_LENGTH)
    model = encoder.model.to(device).eval()
    xs, ys = [], []
    with torch.inference_mode():
        for i in range(0, len(feats), batch_size):
            b = collate(feats[i : i + batch_size], int(encoder.tokenizer.pad_token_id or 0), ds.kind, device)
            hidden = model(b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            words = b["labels"] != IGNORE
            xs.append(F.normalize(hidden[words], dim=-1).float().cpu())
            ys.append(b["labels"][words].cpu())
    return torch.cat(xs).numpy(), torch.cat(ys).numpy()


def _cosine_spearman(encoder: Encoder, ds: Dataset, device: torch.device) -> float:
    a = embed(encoder, [e.text for e in ds.examples], device)
    b = embed(encoder, [e.text_pair or "" for e in ds.examples], device)
    return spearman((a * b).sum(1), np.array([float(e.label or 0.0) for e in ds.examples]))


def setfit(model_path: str, train: Dataset, test: Dataset, seed: int, device: torch.device) -> BaselineResult:
    """SetFit with its default settings on every row of ``train``, the body loaded from ``model_path``."""
    from datasets import Dataset as HFDataset  # the baselines extra: imported only where SetFit runs
    from setfit import SetFitModel, Trainer, TrainingArguments

    model = SetFitModel.from_pretrained(model_path, device=str(device))
    rows = HFDataset.from_dict({"text": _texts(train), "label": _labels(train)})
    with tempfile.TemporaryDirectory() as out:  # its checkpoints, kept nowhere
        Trainer(model=model, args=TrainingArguments(output_dir=out, seed=seed), train_dataset=rows).train()
    predicted = model.predict(_texts(test), batch_size=64, show_progress_bar=False)
    return BaselineResult(
        test=_accuracy(predicted, test),
        dev=None,
        settings={"setfit": version("setfit"), "sentence-transformers": version("sentence-transformers")},
    )
