"""What evaluation hands on: a model's Metrics on a labelled split (the run's metrics.json), which
promotion gates on and the report shows."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from tasks.train.contract import Predictions


class Metrics(BaseModel):
    """A model's scores on a labelled split (the run's metrics.json)."""

    accuracy: float
    macro_f1: float
    confusion_matrix: list[list[int]]  # true x predicted
    label_names: list[str]
    rows: int

    @classmethod
    def of_confusion(cls, counts: np.ndarray, label_names: list[str]) -> Metrics:
        """Accuracy and macro F1 from the confusion matrix (true x predicted), which is all a streamed
        evaluation keeps; F1 of a class is 2 TP / (predicted + actual), 0 where both are 0."""
        true_positives, predicted, actual = np.diag(counts), counts.sum(0), counts.sum(1)
        f1 = np.divide(
            2 * true_positives, predicted + actual, out=np.zeros(len(label_names)), where=predicted + actual > 0
        )
        return cls(
            accuracy=float(true_positives.sum() / counts.sum()),
            macro_f1=float(f1.mean()),
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

    def confusion_markdown(self) -> str:
        names = self.label_names
        lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [
            f"| **{name}** | " + " | ".join(map(str, row)) + " |"
            for name, row in zip(names, self.confusion_matrix, strict=True)
        ]
        return "\n".join(lines)
