"""The scoring two stages share: F1 from counts, the multi-label decision thresholds (tuned by the
training workers on the validation split, applied by the predictor), and the correlations of
regression. Imports numpy only: every training worker imports it."""

from __future__ import annotations

import numpy as np

THRESHOLD = 0.5  # a label's decision threshold where none was tuned (no validation row has the label)
GRID = np.round(np.arange(0.05, 0.96, 0.05), 2)  # the thresholds tried per label


def f1_scores(true_positives: np.ndarray, predicted: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """F1 per class or label: 2 TP / (predicted + actual), 0 where both are 0."""
    total = predicted + actual
    return np.divide(2 * true_positives, total, out=np.zeros(len(total)), where=total > 0)


def tuned_thresholds(outputs: list[list[float]], targets: list[list[float]]) -> list[float]:
    """Per label, the threshold of GRID with the best F1 over a split's rows (each row's probabilities
    and its true labels, multi-hot); of equals, the nearest 0.5; THRESHOLD where no row has the label."""
    probabilities, truth = np.asarray(outputs), np.asarray(targets) > 0.5
    decided = probabilities[:, :, None] >= GRID  # rows x labels x thresholds
    hits = (decided & truth[:, :, None]).sum(0)
    f1 = 2 * hits / np.maximum(decided.sum(0) + truth.sum(0)[:, None], 1)
    nearest_half = -np.abs(GRID - THRESHOLD)
    best = np.lexsort((np.broadcast_to(nearest_half, f1.shape), f1), axis=1)[:, -1]
    return [float(GRID[i]) if truth[:, label].any() else THRESHOLD for label, i in enumerate(best)]


def ranks(values: np.ndarray) -> np.ndarray:
    """Each value's rank, ties given their mean rank (Spearman's convention). Written out: pandas' and
    scipy's rank would add their imports to every training worker, which tunes thresholds here."""
    order = np.empty(len(values))
    order[values.argsort(kind="stable")] = np.arange(len(values))
    _, tie, count = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(tie, weights=order) / count)[tie]


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's r; 0 where either side is constant (r is not defined there)."""
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])
