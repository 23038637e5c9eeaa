"""What evaluation hands on: a model's metrics on a labelled split (the run's metrics.json), which
promotion gates on and the report shows, one class per task (tasks/core/targets.py), each with the
scores of a model that learned nothing (the promotion gate's default floor). The arithmetic they
share with training is tasks/core/scoring.py."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field

from tasks.contracts.training import Predictions
from tasks.core.scoring import correlation, f1_scores, ranks
from tasks.core.tagging import OUTSIDE, entity_types, type_of


class Floor(BaseModel):
    """What a model that learned nothing scores on the same rows, and how it predicts: the promotion
    gate's default floor."""

    scores: dict[str, float]
    words: str


class Metrics(BaseModel):
    """A single-label model's scores on a labelled split (the run's metrics.json)."""

    task: Literal["single_label"] = "single_label"
    accuracy: float
    macro_f1: float
    confusion_matrix: list[list[int]]  # true x predicted
    label_names: list[str]
    rows: int
    floor: Floor | None = None  # set by evaluation (with_floor)

    @classmethod
    def of_confusion(cls, counts: np.ndarray, label_names: list[str]) -> Metrics:
        """Accuracy and macro F1 from the confusion matrix (true x predicted), which is all a streamed
        evaluation keeps; F1 of a class is 2 TP / (predicted + actual), 0 where both are 0."""
        true_positives, predicted, actual = np.diag(counts), counts.sum(0), counts.sum(1)
        return cls(
            accuracy=float(true_positives.sum() / counts.sum()),
            macro_f1=float(f1_scores(true_positives, predicted, actual).mean()),
            confusion_matrix=counts.tolist(),
            label_names=label_names,
            rows=int(counts.sum()),
        )

    @classmethod
    def of_predictions(cls, predictions: Predictions, label_names: list[str]) -> Metrics:
        """The metrics of labels predicted by row against the true ones."""
        counts = np.zeros((len(label_names), len(label_names)), dtype=np.int64)
        truth, labels = (np.asarray(values, dtype=np.int64) for values in (predictions.truth, predictions.labels))
        np.add.at(counts, (truth, labels), 1)
        return cls.of_confusion(counts, label_names)

    def with_floor(self) -> Metrics:
        """With the scores of always predicting the split's majority class (from the confusion matrix's
        true counts)."""
        actual = np.asarray(self.confusion_matrix).sum(1)
        majority = int(actual.argmax())
        one_class = np.zeros((len(actual), len(actual)), dtype=np.int64)
        one_class[:, majority] = actual
        scores = Metrics.of_confusion(one_class, self.label_names)
        words = f"always predicting the test split's majority class '{self.label_names[majority]}'"
        return self.model_copy(update={"floor": Floor(scores=scores.scores(), words=words)})

    def scores(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "macro_f1": self.macro_f1}

    def confusion_markdown(self) -> str:
        names = self.label_names
        lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [
            f"| **{name}** | " + " | ".join(map(str, row)) + " |"
            for name, row in zip(names, self.confusion_matrix, strict=True)
        ]
        return "\n".join(lines)


class LabelScores(BaseModel):
    """One label's scores in a multi-label evaluation, at its threshold."""

    name: str
    threshold: float
    precision: float
    recall: float
    f1: float
    support: int  # rows that have the label
    predicted: int  # rows the model gave it


class MultiLabelMetrics(BaseModel):
    """A multi-label model's scores on a labelled split, each label decided at its threshold."""

    task: Literal["multi_label"] = "multi_label"
    micro_f1: float
    macro_f1: float
    subset_accuracy: float  # rows with every label right
    labels: list[LabelScores]
    rows: int
    floor: Floor | None = None

    @classmethod
    def of(cls, decided: np.ndarray, truth: np.ndarray, names: list[str], thresholds: list[float]) -> MultiLabelMetrics:
        """From the labels decided (rows x labels, booleans) and the true ones."""
        truth = truth > 0.5
        hits, predicted, actual = (decided & truth).sum(0), decided.sum(0), truth.sum(0)
        f1 = f1_scores(hits, predicted, actual)
        labels = [
            LabelScores(
                name=name,
                threshold=threshold,
                precision=float(hit / given) if given else 0.0,
                recall=float(hit / have) if have else 0.0,
                f1=float(score),
                support=int(have),
                predicted=int(given),
            )
            for name, threshold, hit, given, have, score in zip(
                names, thresholds, hits, predicted, actual, f1, strict=True
            )
        ]
        return cls(
            micro_f1=float(f1_scores(*(np.atleast_1d(count.sum()) for count in (hits, predicted, actual)))[0]),
            macro_f1=float(f1.mean()),
            subset_accuracy=float((decided == truth).all(1).mean()),
            labels=labels,
            rows=len(truth),
        )

    @classmethod
    def of_predictions(
        cls, predictions: Predictions, names: list[str], thresholds: list[float], label_shares: tuple[float, ...]
    ) -> MultiLabelMetrics:
        """At the thresholds, with the scores of giving each label to every row or to none, as most
        training rows (label_shares) have it or not."""
        probabilities, truth = np.asarray(predictions.outputs), np.asarray(predictions.targets)
        metrics = cls.of(probabilities >= np.asarray(thresholds), truth, names, thresholds)
        majority = np.broadcast_to(np.asarray(label_shares) > 0.5, truth.shape)
        words = "giving each label to every row or to none, as most training rows have it or not"
        floor = Floor(scores=cls.of(majority, truth, names, thresholds).scores(), words=words)
        return metrics.model_copy(update={"floor": floor})

    def scores(self) -> dict[str, float]:
        return {"micro_f1": self.micro_f1, "macro_f1": self.macro_f1, "subset_accuracy": self.subset_accuracy}


class OutputScores(BaseModel):
    """One regression output's scores."""

    name: str
    mse: float
    mae: float
    pearson: float  # 0 where the predictions or the targets are constant (no correlation defined)
    spearman: float


class RegressionMetrics(BaseModel):
    """A regression model's scores on a labelled split: each output's, and their means."""

    task: Literal["regression"] = "regression"
    mse: float
    mae: float
    pearson: float
    spearman: float
    outputs: list[OutputScores]
    rows: int
    floor: Floor | None = None

    @classmethod
    def of(cls, predicted: np.ndarray, truth: np.ndarray, names: list[str]) -> RegressionMetrics:
        outputs = [
            OutputScores(
                name=name,
                mse=float(np.mean((guess - true) ** 2)),
                mae=float(np.mean(np.abs(guess - true))),
                pearson=correlation(guess, true),
                spearman=correlation(ranks(guess), ranks(true)),
            )
            for name, guess, true in zip(names, predicted.T, truth.T, strict=True)
        ]
        means = {
            key: float(np.mean([getattr(o, key) for o in outputs])) for key in ("mse", "mae", "pearson", "spearman")
        }
        return cls(**means, outputs=outputs, rows=len(truth))

    @classmethod
    def of_predictions(
        cls, predictions: Predictions, names: list[str], training_means: tuple[float, ...]
    ) -> RegressionMetrics:
        """With the scores of predicting the training split's mean for every row."""
        predicted, truth = np.asarray(predictions.outputs), np.asarray(predictions.targets)
        constant = np.broadcast_to(np.asarray(training_means), truth.shape)
        floor = Floor(scores=cls.of(constant, truth, names).scores(), words="predicting the training split's mean")
        return cls.of(predicted, truth, names).model_copy(update={"floor": floor})

    def scores(self) -> dict[str, float]:
        return {"mse": self.mse, "mae": self.mae, "pearson": self.pearson, "spearman": self.spearman}


def flat(rows: list[list[int]]) -> np.ndarray:
    return np.fromiter((value for row in rows for value in row), dtype=np.int64)


class TypeScores(BaseModel):
    """One entity type's scores in a token-classification evaluation."""

    name: str
    precision: float
    recall: float
    f1: float
    support: int  # entities of the type in the split


class TokenMetrics(BaseModel):
    """A token classifier's scores on a labelled split: entity-level precision, recall and F1 (strict
    IOB2, micro over entities: tasks/core/scoring.py), per entity type, and word accuracy; with the
    confusion of words' entity types (O included), true x predicted."""

    task: Literal["token_classification"] = "token_classification"
    entity_f1: float
    entity_precision: float
    entity_recall: float
    token_accuracy: float
    types: list[TypeScores]
    confusion_matrix: list[list[int]]  # words, by entity type (O first): true x predicted
    type_names: list[str]
    rows: int
    floor: Floor | None = None

    @classmethod
    def of_predictions(cls, predictions: Predictions, names: tuple[str, ...]) -> TokenMetrics:
        """With the scores of a model that tags every word O."""
        metrics = cls.of(predictions, names)
        outside = names.index(OUTSIDE)
        nothing = predictions.model_copy(update={"tags": [[outside] * len(row) for row in predictions.gold]})
        floor = Floor(scores=cls.of(nothing, names).scores(), words="tagging every word O")
        return metrics.model_copy(update={"floor": floor})

    @classmethod
    def of(cls, predictions: Predictions, names: tuple[str, ...]) -> TokenMetrics:
        scores, kinds = predictions.entity_scores(names), [OUTSIDE, *entity_types(names)]
        kind_of = np.asarray([kinds.index(type_of(name)) if name != OUTSIDE else 0 for name in names])
        truth, guessed = (
            np.concatenate([np.asarray(row, dtype=np.int64) for row in rows] or [np.zeros(0, np.int64)])
            for rows in (predictions.gold, predictions.tags)
        )
        counts = np.zeros((len(kinds), len(kinds)), dtype=np.int64)
        np.add.at(counts, (kind_of[truth], kind_of[guessed]), 1)
        types = [
            TypeScores(
                name=name,
                precision=found["precision"],
                recall=found["recall"],
                f1=found["f1-score"],
                support=int(found["support"]),
            )
            for name, found in sorted(scores.types.items())
        ]
        return cls(
            entity_f1=scores.f1,
            entity_precision=scores.precision,
            entity_recall=scores.recall,
            token_accuracy=predictions.accuracy,
            types=types,
            confusion_matrix=counts.tolist(),
            type_names=kinds,
            rows=predictions.rows,
        )

    def scores(self) -> dict[str, float]:
        return {
            "entity_f1": self.entity_f1,
            "entity_precision": self.entity_precision,
            "entity_recall": self.entity_recall,
            "token_accuracy": self.token_accuracy,
        }


AnyMetrics = Annotated[Metrics | MultiLabelMetrics | RegressionMetrics | TokenMetrics, Field(discriminator="task")]


def details_markdown(metrics: AnyMetrics) -> str:
    """What a table of scores does not show: the confusion matrix, each label's, output's or entity type's scores."""
    if isinstance(metrics, Metrics):
        return metrics.confusion_markdown()
    rows = {MultiLabelMetrics: "labels", RegressionMetrics: "outputs", TokenMetrics: "types"}[type(metrics)]
    rows = getattr(metrics, rows)
    fields = [name for name in type(rows[0]).model_fields if name != "name"]
    lines = ["| | " + " | ".join(fields) + " |", "|---" * (len(fields) + 1) + "|"]
    lines += [
        f"| **{row.name}** | " + " | ".join(f"{getattr(row, field):.4g}" for field in fields) + " |" for row in rows
    ]
    return "\n".join(lines)
