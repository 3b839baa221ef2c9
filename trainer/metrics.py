"""Evaluation metrics per task kind. The first metric of each kind is the one model selection maximises."""

from __future__ import annotations

import numpy as np

PRIMARY = {"classification": "accuracy", "regression": "spearman", "token-classification": "token_accuracy"}


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


def compute(kind: str, preds: np.ndarray, golds: np.ndarray) -> dict[str, float]:
    """Metrics for ``kind``: classification/tagging take label ids, regression takes values."""
    if kind == "regression":
        return {
            "spearman": spearman(preds, golds),
            "pearson": pearson(preds, golds),
            "mse": float(np.mean((preds - golds) ** 2)),
        }
    acc = float(np.mean(preds == golds)) if golds.size else 0.0
    return {PRIMARY[kind]: acc}
