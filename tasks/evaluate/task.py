"""Stage 3, the Prefect side: held-out metrics of the trained model, stored and shown as Prefect
artifacts, from the labels the trained engine gave the test split where it was trained
(tasks/train/worker.py); tasks/evaluate/contract.py computes them."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.core import storage
from tasks.core.data import Split, shown
from tasks.core.layout import RunStore
from tasks.evaluate.contract import Metrics
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.train.contract import Predictions


@task(**RETRY_TRANSIENT)
def evaluate(store: RunStore, test: Split, predictions: Predictions) -> Metrics:
    """Accuracy, macro F1 and the confusion matrix of the run's model on the test split, as the trained
    engine labelled it -> the run's metrics.json + artifacts."""
    model_uri = store.model_dir
    if len(predictions.labels) != test.total_rows:
        raise RuntimeError(f"training labelled {len(predictions.labels)} test rows of {test.total_rows}")
    metrics = Metrics.of_predictions(predictions, list(test.schema.label_names))
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
        markdown=f"### Confusion matrix on {shown(test.uris)}\n\n{metrics.confusion_markdown()}\n",
        description="Rows: true labels; columns: predicted labels",
    )
    get_run_logger().info(
        "test accuracy %.4f, macro F1 %.4f on %d rows", metrics.accuracy, metrics.macro_f1, metrics.rows
    )
    return metrics
