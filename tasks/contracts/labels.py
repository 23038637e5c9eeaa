"""What batch inference reads and hands on: the columns it reads of a file (Reading), the labels'
Parquet schema for each task (what a model's actors write, and what the test split's labels from
training are written as) and Labelled, what a job labelled."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
from pydantic import BaseModel

from tasks.core.config import InferenceConfig
from tasks.core.targets import Targets


@dataclass(frozen=True)
class Reading:
    """The columns batch inference reads of a file to label: the text (and a pair's second text) it
    labels, and the ids it writes (default: '<file>:<row>')."""

    text_column: str = "text"
    text_pair_column: str | None = None
    id_column: str | None = None
    pair_id_column: str | None = None

    @classmethod
    def of(cls, cfg: InferenceConfig) -> Reading:
        return cls(cfg.text_column or "text", cfg.text_pair_column, cfg.id_column, cfg.pair_id_column)

    @property
    def columns(self) -> list[str]:
        """The columns a file must hold."""
        return [c for c in (self.text_column, self.text_pair_column, self.id_column, self.pair_id_column) if c]

    def texts(self, frame: pd.DataFrame) -> tuple[list[str], list[str] | None]:
        pairs = frame[self.text_pair_column].astype(str).tolist() if self.text_pair_column else None
        return frame[self.text_column].astype(str).tolist(), pairs

    def rows(self, frame: pd.DataFrame, first_row: int, name: str) -> dict[str, list | pd.Series]:
        """A window's ids and texts, as labels_schema names them."""
        ids = (
            frame[self.id_column].astype(str)
            if self.id_column
            else [f"{name}:{first_row + i}" for i in range(len(frame))]
        )
        texts, pairs = self.texts(frame)
        found = {"id": ids, "text": texts} | ({"text_pair": pairs} if pairs is not None else {})
        return found | ({"pair_id": frame[self.pair_id_column].astype(str)} if self.pair_id_column else {})


# An entity batch inference found: its text, its type, its character offsets [start, end) into the
# row's text, and its words' mean probability.
ENTITY = pa.struct(
    {"text": pa.string(), "label": pa.string(), "start": pa.int32(), "end": pa.int32(), "score": pa.float32()}
)


def labels_schema(targets: Targets, pair_ids: bool = False) -> pa.Schema:
    """Each row's id and text (a pair's second text too, and its id where given), and what the model
    says of it: its class and that class's probability (single_label); the labels over their
    thresholds and every label's probability, in the order the file's metadata names them
    (multi_label); a number per output, in a column named by it (regression); its entities, with their
    character offsets into the text, and for a row given as words a tag per word (token_classification)."""
    row = {"id": pa.string(), "text": pa.string()}
    if targets.task == "token_classification":
        return pa.schema(row | {"entities": pa.list_(ENTITY), "tags": pa.list_(pa.string())})
    row |= {"text_pair": pa.string()} if targets.pairs else {}
    row |= {"pair_id": pa.string()} if pair_ids else {}
    if targets.task == "single_label":
        return pa.schema(row | {"label": pa.string(), "score": pa.float32()})
    if targets.task == "multi_label":
        named = {b"ftflow.label_names": json.dumps(list(targets.names)).encode()}
        return pa.schema(row | {"labels": pa.list_(pa.string()), "scores": pa.list_(pa.float32())}, metadata=named)
    return pa.schema(row | dict.fromkeys(targets.names, pa.float32()))


class Labelled(BaseModel):
    """What a batch-inference job labelled, where, and how fast."""

    output_uri: str
    rows: int
    files: int
    seconds: float
    rows_per_s: float
    actors: int  # 0: the labels the trained engine gave the test split, written without a model
    parts: int
