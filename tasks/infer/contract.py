"""What batch inference hands on: the labels' Parquet schema for each task (what a model's actors write,
and what the test split's labels from training are written as) and Labelled, what a job labelled."""

from __future__ import annotations

import json

import pyarrow as pa
from pydantic import BaseModel

from tasks.core.targets import Targets

ROW = {"id": pa.string(), "text": pa.string()}


def labels_schema(targets: Targets) -> pa.Schema:
    """Each row's id and text, and what the model says of it: its class and that class's probability
    (single_label); the labels over their thresholds and every label's probability, in the order the
    file's metadata names them (multi_label); a number per output, in a column named by it (regression)."""
    if targets.task == "single_label":
        return pa.schema(ROW | {"label": pa.string(), "score": pa.float32()})
    if targets.task == "multi_label":
        named = {b"ftflow.label_names": json.dumps(list(targets.names)).encode()}
        return pa.schema(ROW | {"labels": pa.list_(pa.string()), "scores": pa.list_(pa.float32())}, metadata=named)
    return pa.schema(ROW | dict.fromkeys(targets.names, pa.float32()))


class Labelled(BaseModel):
    """What a batch-inference job labelled, where, and how fast."""

    output_uri: str
    rows: int
    files: int
    seconds: float
    rows_per_s: float
    actors: int  # 0: the labels the trained engine gave the test split, written without a model
    parts: int
