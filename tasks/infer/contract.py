"""What batch inference hands on: the labels' Parquet schema (what a model's actors write, and what
the test split's labels from training are written as) and Labelled, what a job labelled."""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel

LABELS_SCHEMA = pa.schema({"id": pa.string(), "text": pa.string(), "label": pa.string(), "score": pa.float32()})


class Labelled(BaseModel):
    """What a batch-inference job labelled, where, and how fast."""

    output_uri: str
    rows: int
    files: int
    seconds: float
    rows_per_s: float
    actors: int  # 0: the labels the trained engine gave the test split, written without a model
    parts: int
