"""Stage 3: held-out metrics of the trained model, stored and shown as Prefect artifacts."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

from tasks import storage
from tasks.data import Split
from tasks.infer import Predictor


def metrics_of(labels: list[int], predicted: list[int], label_names: list[str]) -> dict:
    ids = list(range(len(label_names)))
    return {
        "accuracy": float(accuracy_score(labels, predicted)),
        "macro_f1": float(f1_score(labels, predicted, labels=ids, average="macro", zero_division=0)),
        "confusion_matrix": confusion_matrix(labels, predicted, labels=ids).tolist(),
        "label_names": label_names,
        "rows": len(labels),
    }


def confusion_markdown(metrics: dict) -> str:
    names = metrics["label_names"]
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| **{name}** | " + " | ".join(map(str, row)) + " |" for name, row in zip(names, metrics["confusion_matrix"])]
    return "\n".join(lines)


@task
def evaluate(model_uri: str, test: Split, metrics_uri: str) -> dict:
    """Accuracy, macro F1 and the confusion matrix on the test split -> metrics.json + artifacts."""
    predictor = Predictor(model_uri)
    predicted, _ = predictor.predict(test.texts)
    metrics = metrics_of(test.labels, predicted.tolist(), predictor.label_names)
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
        markdown=f"### Confusion matrix on {test.uri}\n\n{confusion_markdown(metrics)}\n",
        description="Rows: true labels; columns: predicted labels",
    )
    get_run_logger().info("test accuracy %.4f, macro F1 %.4f on %d rows", metrics["accuracy"], metrics["macro_f1"], metrics["rows"])
    return metrics
