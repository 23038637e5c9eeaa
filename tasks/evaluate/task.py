"""Stage 3, the Prefect side: held-out metrics of the trained model, stored and shown as Prefect
artifacts, from what the trained engine predicted of the test split where it was trained
(tasks/train/worker.py); tasks/contracts/metrics.py computes them, for the run's task."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.contracts.metrics import (
    AnyMetrics,
    Metrics,
    MultiLabelMetrics,
    RegressionMetrics,
    TokenMetrics,
    details_markdown,
)
from tasks.contracts.training import Result
from tasks.core import storage
from tasks.core.data import Split
from tasks.core.files import shown
from tasks.core.layout import RunStore
from tasks.prefect_side.retries import RETRY_TRANSIENT


def test_metrics(splits: dict[str, Split], training: Result) -> AnyMetrics:
    """The task's metrics of the test split as training predicted it, with the floor a model that
    learned nothing gets (the training split's label shares or means, for multi-label and regression)."""
    targets, predictions, train = splits["test"].schema.targets, training.test, splits["train"]
    names = list(targets.names)
    if targets.task == "single_label":
        return Metrics.of_predictions(predictions, names).with_floor()
    if targets.task == "multi_label":
        return MultiLabelMetrics.of_predictions(predictions, names, training.thresholds, train.tally.means)
    if targets.task == "token_classification":
        return TokenMetrics.of_predictions(predictions, targets.names)
    return RegressionMetrics.of_predictions(predictions, names, train.tally.means)


@task(**RETRY_TRANSIENT)
def evaluate(store: RunStore, splits: dict[str, Split], training: Result) -> AnyMetrics:
    """The run's model's metrics on the test split, as the trained engine predicted it -> the run's
    metrics.json + artifacts."""
    test = splits["test"]
    if training.test.rows != test.total_rows:
        raise RuntimeError(f"training labelled {training.test.rows} test rows of {test.total_rows}")
    metrics = test_metrics(splits, training)
    storage.write_json(store.metrics, metrics.model_dump())
    scores = metrics.scores()
    create_table_artifact(
        key="test-metrics",
        table=[{"metric": name, "value": round(value, 4)} for name, value in scores.items()]
        + [{"metric": "rows", "value": metrics.rows}],
        description=f"Test metrics of {store.model_dir}",
    )
    create_markdown_artifact(
        key="confusion-matrix" if isinstance(metrics, Metrics) else "test-details",
        markdown=f"### {metrics.task} scores on {shown(test.uris)}\n\n{details_markdown(metrics)}\n",
        description="Rows: true labels, columns: predicted (single_label); else per label or output",
    )
    get_run_logger().info(
        "test %s on %d rows", ", ".join(f"{name} {value:.4f}" for name, value in scores.items()), metrics.rows
    )
    return metrics
