"""Stage 3, the Prefect side: held-out metrics of the trained model, stored and shown as Prefect
artifacts. The metrics are computed on the cluster by tasks/evaluate/driver.py."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.core import jobs, storage
from tasks.core.config import InferenceConfig
from tasks.core.data import Split, shown
from tasks.core.retries import RETRY_TRANSIENT
from tasks.core.storage import RunStore
from tasks.evaluate.driver import Metrics, score


def confusion_markdown(metrics: Metrics) -> str:
    names = metrics.label_names
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [
        f"| **{name}** | " + " | ".join(map(str, row)) + " |"
        for name, row in zip(names, metrics.confusion_matrix, strict=True)
    ]
    return "\n".join(lines)


@task(**RETRY_TRANSIENT)
def evaluate(store: RunStore, test: Split, inference: InferenceConfig, ray_address: str | None = None) -> Metrics:
    """Accuracy, macro F1 and the confusion matrix of the run's model on the test split, predicted as
    batch inference predicts (inference.batch_size) -> the run's metrics.json + artifacts."""
    model_uri = store.model_dir
    metrics = jobs.run(
        score, ray_address, get_run_logger(), model_uri=model_uri, test=test, batch_size=inference.batch_size
    )
    storage.write_json(store.metrics, metrics.model_dump())
    create_table_artifact(
        key="test-metrics",
        table=[
            {"metric": "accuracy", "value": round(metrics.accuracy, 4)},
            {"metric": "macro_f1", "value": round(metrics.macro_f1, 4)},
            {"metric": "rows", "value": metrics.rows},
        ],
        description=f"Test metrics of {model_uri}",
    )
    create_markdown_artifact(
        key="confusion-matrix",
        markdown=f"### Confusion matrix on {shown(test.uris)}\n\n{confusion_markdown(metrics)}\n",
        description="Rows: true labels; columns: predicted labels",
    )
    get_run_logger().info(
        "test accuracy %.4f, macro F1 %.4f on %d rows", metrics.accuracy, metrics.macro_f1, metrics.rows
    )
    return metrics
