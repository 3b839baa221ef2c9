"""Evaluation metrics per task kind (which of them chooses checkpoints is ``TrainConfig.selection_metric``).

* classification: accuracy and macro-F1 (scikit-learn; every label weighs the same, so a rare intent counts);
* regression: Spearman, Pearson, MSE;
* token-classification: token accuracy, and where the tags follow a BIO / IOB2 / BIOES scheme, entity-level
  precision, recall and F1 as conlleval computes them (seqeval): an entity counts only when its type and both of
  its ends are right, which is what a user of a named-entity tagger cares about.

scikit-learn and seqeval are imported with this module (about a second): a worker pays that once when it
starts, not inside the first job's dev evaluation. The server never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from seqeval.metrics.sequence_labeling import precision_recall_fscore_support as entity_scores
from sklearn.metrics import f1_score

from patchserve.patches.train_config import is_bio_scheme
from patchserve.patches.validation import Label


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


def classification_metrics(preds: np.ndarray, golds: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1 over the labels that occur in gold or predictions (scikit-learn's convention)."""
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
        y_true = [[str(tags[i]) for i in g] for g in golds]
        y_pred = [[str(tags[i]) for i in p] for p in preds]
        # one pass over the entities for all three (seqeval's precision_score, recall_score and f1_score each
        # extract every entity again)
        precision, recall, f1, _ = entity_scores(y_true, y_pred, average="micro", zero_division=0)
        out |= {"entity_precision": float(precision), "entity_recall": float(recall), "entity_f1": float(f1)}
    return out
