"""Stage 3: held-out metrics of the trained model, stored and shown as Prefect artifacts."""

from __future__ import annotations

import numpy as np
import ray
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks import cluster, jobs, storage
from tasks.config import InferenceConfig
from tasks.data import Split, shown
from tasks.predictor import confusion
from tasks.retries import RETRY_TRANSIENT
from tasks.storage import RunStore


def metrics_of(counts: np.ndarray, label_names: list[str]) -> dict:
    """Accuracy and macro F1 from the confusion matrix (true x predicted), which is all a streamed
    evaluation keeps; F1 of a class is 2 TP / (predicted + actual), 0 where both are 0."""
    true_positives, predicted, actual = np.diag(counts), counts.sum(0), counts.sum(1)
    f1 = np.divide(2 * true_positives, predicted + actual, out=np.zeros(len(label_names)), where=predicted + actual > 0)
    return {
        "accuracy": float(true_positives.sum() / counts.sum()),
        "macro_f1": float(f1.mean()),
        "confusion_matrix": counts.tolist(),
        "label_names": label_names,
        "rows": int(counts.sum()),
    }


def confusion_markdown(metrics: dict) -> str:
    names = metrics["label_names"]
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [
        f"| **{name}** | " + " | ".join(map(str, row)) + " |"
        for name, row in zip(names, metrics["confusion_matrix"], strict=True)
    ]
    return "\n".join(lines)


def score(model_uri: str, test: Split, batch_size: int) -> dict:
    """Accuracy, macro F1 and the confusion matrix of a model on a split, computed on the cluster by
    the inference code (tasks/predictor.py), batch_size rows a forward pass, with the CPUs (or a GPU)
    it has to spare. Ray work: tasks/jobs.py runs it where the cluster is."""
    resources = cluster.Resources.of_cluster()
    remote = ray.remote(confusion).options(num_cpus=resources.task_cpus(), num_gpus=min(1, resources.gpus))
    counts, label_names = ray.get(remote.remote(model_uri, test, batch_size, resources.task_cpus()))
    return metrics_of(counts, label_names)


@task(**RETRY_TRANSIENT)
def evaluate(store: RunStore, test: Split, inference: InferenceConfig, ray_address: str | None = None) -> dict:
    """Accuracy, macro F1 and the confusion matrix of the run's model on the test split, predicted as
    batch inference predicts (inference.batch_size) -> the run's metrics.json + artifacts."""
    model_uri = store.model_dir
    metrics = jobs.run(
        score, ray_address, get_run_logger(), model_uri=model_uri, test=test, batch_size=inference.batch_size
    )
    storage.write_json(store.metrics, metrics)
    create_table_artifact(
        key="test-metrics",
        table=[
            {"metric": "accuracy", "value": round(metrics["accuracy"], 4)},
            {"metric": "macro_f1", "value": round(metrics["macro_f1"], 4)},
            {"metric": "rows", "value": metrics["rows"]},
        ],
        description=f"Test metrics of {model_uri}",
    )
    create_markdown_artifact(
        key="confusion-matrix",
        markdown=f"### Confusion matrix on {shown(test.uris)}\n\n{confusion_markdown(metrics)}\n",
        description="Rows: true labels; columns: predicted labels",
    )
    get_run_logger().info(
        "test accuracy %.4f, macro F1 %.4f on %d rows", metrics["accuracy"], metrics["macro_f1"], metrics["rows"]
    )
    return metrics
