"""The champion scored again, on a test split it was not promoted on: predicted by the inference code
(tasks/core/predictor.py) in a Ray task, so no model is loaded by the driver. Imports no Prefect:
tasks/core/jobs.py runs it where the cluster is."""

from __future__ import annotations

import numpy as np
import ray

from tasks.contracts.metrics import AnyMetrics, Metrics, MultiLabelMetrics, RegressionMetrics
from tasks.core import cluster
from tasks.core.data import Split, labelled_frames, target_matrix


def score(model_uri: str, test: Split, batch_size: int) -> AnyMetrics:
    """A model's metrics on a split, for the split's task, batch_size rows a forward pass, with the
    CPUs (or a GPU) the cluster has to spare."""
    resources = cluster.Resources.of_cluster()
    remote = ray.remote(predicted).options(num_cpus=resources.task_cpus(), num_gpus=min(1, resources.gpus))
    outputs, truth, thresholds = ray.get(remote.remote(model_uri, test, batch_size, resources.task_cpus()))
    names = list(test.schema.targets.names)
    if test.schema.targets.task == "single_label":
        counts = np.zeros((len(names), len(names)), dtype=np.int64)
        np.add.at(counts, (truth.argmax(1), outputs.argmax(1)), 1)
        return Metrics.of_confusion(counts, names).with_floor()
    if test.schema.targets.task == "multi_label":
        return MultiLabelMetrics.of(outputs >= np.asarray(thresholds), truth, names, thresholds)
    return RegressionMetrics.of(outputs, truth, names)


def predicted(model_uri: str, split: Split, batch_size: int, threads: int) -> tuple[np.ndarray, np.ndarray, list]:
    """A model's outputs on a labelled split and its targets (rows x outputs: single-label classes
    one-hot), read a chunk at a time, and the model's thresholds; refused where the model is not one
    of the split's task (a champion of another task)."""
    from tasks.core.predictor import Predictor  # torch and transformers: in the task's process only

    predictor, targets = Predictor(model_uri, batch_size, threads), split.schema.targets
    if predictor.targets.task != targets.task:
        raise ValueError(
            f"{model_uri} is a {predictor.targets.task} model, and this run's data.task is {targets.task}: "
            "a registry entry's champion keeps its task; promote under another promotion.model_name"
        )
    outputs, truth = [], []
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):
            outputs.append(predictor.outputs(frame["text"].tolist()))
            truth.append(target_matrix(frame["label"], targets))
    return np.concatenate(outputs), np.concatenate(truth), predictor.thresholds
