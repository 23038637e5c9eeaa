"""The champion scored again, on a test split it was not promoted on: predicted by the inference code
(tasks/core/predictor.py) in a Ray task, so no model is loaded by the driver. Imports no Prefect:
tasks/core/jobs.py runs it where the cluster is."""

from __future__ import annotations

import numpy as np
import ray

from tasks.contracts.metrics import AnyMetrics, Metrics, MultiLabelMetrics, RegressionMetrics, TokenMetrics
from tasks.contracts.training import Predictions
from tasks.core import cluster
from tasks.core.data import Split, labelled_frames, target_matrix
from tasks.core.tagging import OUTSIDE


def score(model_uri: str, test: Split, batch_size: int) -> AnyMetrics:
    """A model's metrics on a split, for the split's task, batch_size rows a forward pass, with the
    CPUs (or a GPU) the cluster has to spare."""
    resources = cluster.Resources.of_cluster()
    options = {"num_cpus": resources.task_cpus(), "num_gpus": min(1, resources.gpus)}
    if test.schema.tagged:
        tagged = ray.remote(predicted_tags).options(**options)
        return TokenMetrics.of(
            ray.get(tagged.remote(model_uri, test, batch_size, resources.task_cpus())), test.schema.label_names
        )
    remote = ray.remote(predicted).options(**options)
    outputs, truth, thresholds = ray.get(remote.remote(model_uri, test, batch_size, resources.task_cpus()))
    names = list(test.schema.targets.names)
    if test.schema.targets.task == "single_label":
        counts = np.zeros((len(names), len(names)), dtype=np.int64)
        np.add.at(counts, (truth.argmax(1), outputs.argmax(1)), 1)
        return Metrics.of_confusion(counts, names).with_floor()
    if test.schema.targets.task == "multi_label":
        return MultiLabelMetrics.of(outputs >= np.asarray(thresholds), truth, names, thresholds)
    return RegressionMetrics.of(outputs, truth, names)


def predictor_of(model_uri: str, split: Split, batch_size: int, threads: int):
    """The model's Predictor, refused where the model is not one of the split's task (a champion of
    another task)."""
    from tasks.core.predictor import Predictor  # torch and transformers: in the task's process only

    predictor, task = Predictor(model_uri, batch_size, threads), split.schema.targets.task
    if predictor.targets.task != task:
        raise ValueError(
            f"{model_uri} is a {predictor.targets.task} model, and this run's data.task is {task}: "
            "a registry entry's champion keeps its task; promote under another promotion.model_name"
        )
    return predictor


def predicted_tags(model_uri: str, split: Split, batch_size: int, threads: int) -> Predictions:
    """A token classifier's tag of each word of a labelled split, and the true ones, by tag id."""
    predictor, names = predictor_of(model_uri, split, batch_size, threads), split.schema.label_names
    # a tag the split does not have (a champion trained on other types): a word it cannot get right, read as O
    by_name, outside = {name: i for i, name in enumerate(names)}, names.index(OUTSIDE)
    tags, gold = [], []
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):
            found = predictor.tagged(frame["text"].tolist())
            tags += [[by_name.get(tag, outside) for tag in row.tags] for row in found]
            gold += frame["label"].tolist()
    return Predictions(task="token_classification", tags=tags, gold=gold)


def predicted(model_uri: str, split: Split, batch_size: int, threads: int) -> tuple[np.ndarray, np.ndarray, list]:
    """A model's outputs on a labelled split and its targets (rows x outputs: single-label classes
    one-hot), read a chunk at a time, and the model's thresholds; refused where the model is not one
    of the split's task (a champion of another task)."""
    predictor, targets = predictor_of(model_uri, split, batch_size, threads), split.schema.targets
    outputs, truth = [], []
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):
            pairs = frame["text_pair"].tolist() if "text_pair" in frame else None  # a pair model's champion
            outputs.append(predictor.outputs(frame["text"].tolist(), pairs))
            truth.append(target_matrix(frame["label"], targets))
    return np.concatenate(outputs), np.concatenate(truth), predictor.thresholds
