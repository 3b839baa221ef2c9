"""Evaluation metrics per task kind, and which of them chooses checkpoints (``selection_metric``).

* classification: accuracy and macro-F1 (scikit-learn; every label weighs the same, so a rare intent counts);
* regression: Spearman, Pearson, MSE;
* token-classification: token accuracy, and where the tags follow a BIO / IOB2 / BIOES scheme, entity-level
  precision, recall and F1 as conlleval computes them (seqeval): an entity counts only when its type and both of
  its ends are right, which is what a user of a named-entity tagger cares about.

The metric that picks the best dev checkpoint (and restart) is the task's ``metric`` setting, else the kind's
default: accuracy, Spearman, and for tags entity F1 when they are BIO-style, else token accuracy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from patches.format import Label
from patches.jobs import SELECTION_METRICS, JobError

# B-/I-/E-/S- followed by a type, or O: IOB2, IOB1 and BIOES tags all look like this
_SCHEME_TAG = re.compile(r"(?:[BIES]-.+|O)")


class MetricError(JobError):
    """The requested selection metric does not apply to this task (an HTTP 422 for a job, a failed job)."""


def is_bio_scheme(tags: Sequence[Label]) -> bool:
    """Whether a tag set reads as entity spans (BIO / IOB2 / BIOES): every tag is O or B-/I-/E-/S-TYPE."""
    return (
        bool(tags)
        and all(isinstance(t, str) and _SCHEME_TAG.fullmatch(t) for t in tags)
        and any(t != "O" for t in tags)
    )


def selection_metric(kind: str, labels: Sequence[Label], requested: str | None = None) -> str:
    """The dev metric that chooses checkpoints for a task of ``kind`` with these labels (tags)."""
    if requested is None:
        if kind == "token-classification" and is_bio_scheme(labels):
            return "entity_f1"
        return SELECTION_METRICS[kind][0]
    if requested not in SELECTION_METRICS[kind]:
        raise MetricError(f"metric {requested!r} does not score a {kind} task; use one of {SELECTION_METRICS[kind]}")
    if requested == "entity_f1" and not is_bio_scheme(labels):
        raise MetricError(
            f"metric 'entity_f1' needs tags in a BIO/IOB2/BIOES scheme (B-PER, I-PER, O...), got {list(labels)[:10]}; "
            "use token_accuracy"
        )
    return requested


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (as scipy.stats.rankdata), 1-based."""
    a = np.asarray(a)
    sorter = np.argsort(a, kind="mergesort")
    inv = np.empty(sorter.size, dtype=np.intp)
    inv[sorter] = np.arange(sorter.size)
    s = a[sorter]
    obs = np.r_[True, s[1:] != s[:-1]]
    dense = obs.cumsum()[inv]
    count = np.r_[np.nonzero(obs)[0], len(obs)]
    return 0.5 * (count[dense] + count[dense - 1] + 1)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(rankdata(x), rankdata(y))


def regression_metrics(preds: np.ndarray, golds: np.ndarray) -> dict[str, float]:
    return {
        "spearman": spearman(preds, golds),
        "pearson": pearson(preds, golds),
        "mse": float(np.mean((preds - golds) ** 2)),
    }


def classification_metrics(preds: np.ndarray, golds: np.ndarray, n_labels: int) -> dict[str, float]:
    """Accuracy and macro-F1 over the labels that occur in gold or predictions (scikit-learn's convention)."""
    from sklearn.metrics import f1_score  # imported here: the server never scores, and need not load it

    if not golds.size:
        return {"accuracy": 0.0, "macro_f1": 0.0}
    return {
        "accuracy": float(np.mean(preds == golds)),
        "macro_f1": float(f1_score(golds, preds, average="macro", labels=None, zero_division=0)),
    }


def tagging_metrics(preds: list[np.ndarray], golds: list[np.ndarray], tags: Sequence[Label]) -> dict[str, float]:
    """Token accuracy over every scored word; with BIO-style tags, entity precision/recall/F1 (micro, conlleval)."""
    flat_p = np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64)
    flat_g = np.concatenate(golds) if golds else np.zeros(0, dtype=np.int64)
    out = {"token_accuracy": float(np.mean(flat_p == flat_g)) if flat_g.size else 0.0}
    if is_bio_scheme(tags):
        from seqeval.metrics import f1_score, precision_score, recall_score

        y_true = [[str(tags[i]) for i in g] for g in golds]
        y_pred = [[str(tags[i]) for i in p] for p in preds]
        out["entity_precision"] = float(precision_score(y_true, y_pred, zero_division=0))
        out["entity_recall"] = float(recall_score(y_true, y_pred, zero_division=0))
        out["entity_f1"] = float(f1_score(y_true, y_pred, zero_division=0))
    return out
