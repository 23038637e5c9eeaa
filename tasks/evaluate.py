"""Stage 3: held-out metrics of the trained model, stored and shown as Prefect artifacts."""

from __future__ import annotations

import numpy as np
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from sklearn.metrics import confusion_matrix

from tasks import storage
from tasks.data import Split, labelled_frames, shown
from tasks.predictor import Predictor


def metrics_of(confusion: np.ndarray, label_names: list[str]) -> dict:
    """Accuracy and macro F1 from the confusion matrix (true x predicted), which is all a streamed
    evaluation keeps; F1 of a class is 2 TP / (predicted + actual), 0 where both are 0."""
    true_positives, predicted, actual = np.diag(confusion), confusion.sum(0), confusion.sum(1)
    f1 = np.divide(2 * true_positives, predicted + actual, out=np.zeros(len(label_names)), where=predicted + actual > 0)
    return {
        "accuracy": float(true_positives.sum() / confusion.sum()),
        "macro_f1": float(f1.mean()),
        "confusion_matrix": confusion.tolist(),
        "label_names": label_names,
        "rows": int(confusion.sum()),
    }


def confusion_markdown(metrics: dict) -> str:
    names = metrics["label_names"]
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| **{name}** | " + " | ".join(map(str, row)) + " |" for name, row in zip(names, metrics["confusion_matrix"])]
    return "\n".join(lines)


def score(model_uri: str, test: Split) -> dict:
    """Accuracy, macro F1 and the confusion matrix of a model on a split, streamed a chunk at a time."""
    predictor = Predictor(model_uri)
    ids = list(range(len(predictor.label_names)))
    confusion = np.zeros((len(ids), len(ids)), dtype=np.int64)
    for uri in test.uris:
        for frame in labelled_frames(uri, test.schema):  # a chunk at a time, never the whole split
            predicted, _ = predictor.predict(frame["text"].tolist())
            confusion += confusion_matrix(frame["label"], predicted, labels=ids)
    return metrics_of(confusion, predictor.label_names)


@task
def evaluate(model_uri: str, test: Split, metrics_uri: str) -> dict:
    """Accuracy, macro F1 and the confusion matrix on the test split -> metrics.json + artifacts."""
    metrics = score(model_uri, test)
    storage.write_json(metrics_uri, metrics)
    create_table_artifact(
        key="test-metrics",
        table=[{"metric": "accuracy", "value": round(metrics["accuracy"], 4)},
               {"metric": "macro_f1", "value": round(metrics["macro_f1"], 4)},
               {"metric": "rows", "value": metrics["rows"]}],
        description=f"Test metrics of {model_uri}",
    )
    create_markdown_artifact(
        key="confusion-matrix",
        markdown=f"### Confusion matrix on {shown(test.uris)}\n\n{confusion_markdown(metrics)}\n",
        description="Rows: true labels; columns: predicted labels",
    )
    get_run_logger().info("test accuracy %.4f, macro F1 %.4f on %d rows", metrics["accuracy"], metrics["macro_f1"], metrics["rows"])
    return metrics
