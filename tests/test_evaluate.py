"""Evaluation's numbers for each task, against scikit-learn's and scipy's own on the same rows."""

from __future__ import annotations

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score

from tasks.contracts.metrics import MultiLabelMetrics, RegressionMetrics
from tasks.contracts.training import Predictions
from tasks.core.scoring import GRID, THRESHOLD, tuned_thresholds


def test_multi_label_thresholds_are_tuned_per_label_and_scores_match_scikit_learn():
    rng = np.random.default_rng(0)
    truth = (rng.random((400, 3)) < [0.5, 0.1, 0.0]).astype(float)  # the last label: no row has it
    probabilities = np.clip(truth * 0.3 + rng.random((400, 3)) * 0.6, 0, 1)  # right above ~0.3, not 0.5
    validation = Predictions(task="multi_label", outputs=probabilities.tolist(), targets=truth.tolist())
    thresholds = tuned_thresholds(validation.outputs, validation.targets)
    for label in range(2):  # the grid's best F1 on the validation rows, of equals the nearest 0.5
        f1 = [f1_score(truth[:, label], probabilities[:, label] >= t) for t in GRID]
        assert thresholds[label] == min(
            (t for t, s in zip(GRID, f1, strict=True) if s == max(f1)), key=lambda t: abs(t - 0.5)
        )
    assert thresholds[2] == THRESHOLD and thresholds[1] != THRESHOLD
    metrics = MultiLabelMetrics.of_predictions(validation, ["a", "b", "c"], thresholds, (0.6, 0.1, 0.0))
    decided = probabilities >= thresholds
    assert metrics.micro_f1 == f1_score(truth, decided, average="micro", zero_division=0)
    assert np.isclose(metrics.macro_f1, f1_score(truth, decided, average="macro", zero_division=0))
    assert metrics.floor.scores["micro_f1"] == f1_score(truth, np.broadcast_to([1, 0, 0], truth.shape), average="micro")


def test_regression_scores_match_scipy_and_the_floor_is_the_training_mean():
    rng = np.random.default_rng(0)
    truth = rng.normal(3, 0.4, (300, 2))
    predicted = truth + rng.normal(0, 0.3, truth.shape)
    predicted[:5] = predicted[5]  # ties, which Spearman ranks by their mean
    test = Predictions(task="regression", outputs=predicted.tolist(), targets=truth.tolist())
    metrics = RegressionMetrics.of_predictions(test, ["valence", "arousal"], (3.1, 2.9))
    for column, output in enumerate(metrics.outputs):
        assert np.isclose(output.pearson, pearsonr(predicted[:, column], truth[:, column]).statistic)
        assert np.isclose(output.spearman, spearmanr(predicted[:, column], truth[:, column]).statistic)
        assert np.isclose(output.mse, np.mean((predicted[:, column] - truth[:, column]) ** 2))
    assert np.isclose(metrics.floor.scores["mse"], np.mean((truth - [3.1, 2.9]) ** 2))
    assert metrics.floor.scores["pearson"] == 0.0, "a constant has no correlation"
