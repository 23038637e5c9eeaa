"""The champion scored again, on a test split it was not promoted on: its confusion matrix predicted
by the inference code (tasks/core/predictor.py) in a Ray task, so no model is loaded by the driver.
Imports no Prefect: tasks/core/jobs.py runs it where the cluster is."""

from __future__ import annotations

import numpy as np
import ray

from tasks.core import cluster
from tasks.core.data import Split, labelled_frames
from tasks.evaluate.contract import Metrics


def score(model_uri: str, test: Split, batch_size: int) -> Metrics:
    """Accuracy, macro F1 and the confusion matrix of a model on a split, batch_size rows a forward
    pass, with the CPUs (or a GPU) the cluster has to spare."""
    resources = cluster.Resources.of_cluster()
    remote = ray.remote(confusion).options(num_cpus=resources.task_cpus(), num_gpus=min(1, resources.gpus))
    counts, label_names = ray.get(remote.remote(model_uri, test, batch_size, resources.task_cpus()))
    return Metrics.of_confusion(counts, label_names)


def confusion(model_uri: str, split: Split, batch_size: int, threads: int) -> tuple[np.ndarray, list[str]]:
    """The confusion matrix (true x predicted) of a model on a labelled split, streamed a chunk at a
    time, and the model's label names."""
    from tasks.core.predictor import Predictor  # torch and transformers: in the task's process only

    predictor = Predictor(model_uri, batch_size, threads)
    ids = list(range(len(predictor.label_names)))
    counts = np.zeros((len(ids), len(ids)), dtype=np.int64)
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):  # a chunk at a time, never the whole split
            predicted, _ = predictor.predict(frame["text"].tolist())
            np.add.at(counts, (frame["label"].to_numpy(), predicted), 1)
    return counts, predictor.label_names
