"""The scoring two stages share: F1 from counts, the multi-label decision thresholds (tuned by the
training workers on the validation split, applied by the predictor), and the correlations of
regression. Imports numpy only: every training worker imports it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.core.tagging import OUTSIDE, as_iob2, scheme_of

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


@dataclass(frozen=True)
class EntityScores:
    """Entity-level scores over a split (micro over entities) and per entity type: an entity counts
    as found where its type, first and last word are all right (strict IOB2)."""

    precision: float
    recall: float
    f1: float
    types: dict[str, dict[str, float]]  # per type: precision, recall, f1-score, support (seqeval's names)


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> EntityScores:
    """By seqeval (strict mode, IOB2), the reference implementation of CoNLL's entity scoring; plain
    tags read as IOB2, each run of one tag an entity. Imported here: 1 s of scikit-learn."""
    from seqeval.metrics import classification_report
    from seqeval.scheme import IOB2

    names = {tag for rows in (gold, predicted) for row in rows for tag in row}
    if names <= {OUTSIDE}:  # no entity on either side: seqeval averages over no type (NaN, and a warning)
        return EntityScores(0.0, 0.0, 0.0, {})
    if scheme_of(sorted(names)) == "plain":
        gold, predicted = [as_iob2(row) for row in gold], [as_iob2(row) for row in predicted]
    report = classification_report(gold, predicted, mode="strict", scheme=IOB2, output_dict=True, zero_division=0)
    micro = report.pop("micro avg")
    types = {
        name: {key: float(value) for key, value in scores.items()}
        for name, scores in report.items()
        if not name.endswith(" avg")
    }
    return EntityScores(float(micro["precision"]), float(micro["recall"]), float(micro["f1-score"]), types)
