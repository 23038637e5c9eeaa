"""Stage 3 without Prefect: the metrics of the labels the trained engine gave the test split
(tasks/train/worker.py), and, for a model on its own from storage (the champion), its confusion matrix
on a labelled split, predicted by the inference code (tasks/infer/predictor.py) in a Ray task."""

from __future__ import annotations

import numpy as np
import ray
from pydantic import BaseModel

from tasks.core import cluster
from tasks.core.data import Split, labelled_frames
from tasks.train.contract import Predictions


class Metrics(BaseModel):
    """A model's scores on a labelled split (the run's metrics.json)."""

    accuracy: float
    macro_f1: float
    confusion_matrix: list[list[int]]  # true x predicted
    label_names: list[str]
    rows: int


def metrics_of(counts: np.ndarray, label_names: list[str]) -> Metrics:
    """Accuracy and macro F1 from the confusion matrix (true x predicted), which is all a streamed
    evaluation keeps; F1 of a class is 2 TP / (predicted + actual), 0 where both are 0."""
    true_positives, predicted, actual = np.diag(counts), counts.sum(0), counts.sum(1)
    f1 = np.divide(2 * true_positives, predicted + actual, out=np.zeros(len(label_names)), where=predicted + actual > 0)
    return Metrics(
        accuracy=float(true_positives.sum() / counts.sum()),
        macro_f1=float(f1.mean()),
        confusion_matrix=counts.tolist(),
        label_names=label_names,
        rows=int(counts.sum()),
    )


def scored(predictions: Predictions, label_names: list[str]) -> Metrics:
    """The metrics of labels predicted by row against the true ones."""
    counts = np.zeros((len(label_names), len(label_names)), dtype=np.int64)
    np.add.at(
        counts, (np.asarray(predictions.truth, dtype=np.int64), np.asarray(predictions.labels, dtype=np.int64)), 1
    )
    return metrics_of(counts, label_names)


def score(model_uri: str, test: Split, batch_size: int) -> Metrics:
    """Accuracy, macro F1 and the confusion matrix of a model on a split, computed on the cluster by
    the inference code (tasks/infer/predictor.py), batch_size rows a forward pass, with the CPUs (or a GPU)
    it has to spare. Ray work: tasks/core/jobs.py runs it where the cluster is."""
    resources = cluster.Resources.of_cluster()
    remote = ray.remote(confusion).options(num_cpus=resources.task_cpus(), num_gpus=min(1, resources.gpus))
    counts, label_names = ray.get(remote.remote(model_uri, test, batch_size, resources.task_cpus()))
    return metrics_of(counts, label_names)


def confusion(model_uri: str, split: Split, batch_size: int, threads: int) -> tuple[np.ndarray, list[str]]:
    """The confusion matrix (true x predicted) of a model on a labelled split, streamed a chunk at a
    time, and the model's label names: run as a Ray task, so no model is loaded by the driver."""
    from tasks.infer.predictor import Predictor  # torch and transformers: in the task's process only

    predictor = Predictor(model_uri, batch_size, threads)
    ids = list(range(len(predictor.label_names)))
    counts = np.zeros((len(ids), len(ids)), dtype=np.int64)
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):  # a chunk at a time, never the whole split
            predicted, _ = predictor.predict(frame["text"].tolist())
            np.add.at(counts, (frame["label"].to_numpy(), predicted), 1)
    return counts, predictor.label_names
