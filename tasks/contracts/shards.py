"""What tokenization hands on: each split's shards, Parquet files of `shard_schema` rows under
<root>/tokenized/<content-key>/<split>/ (tasks/core/layout.py), which training reads."""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel

from tasks.core.targets import Targets


class TokenizedSplits(BaseModel, frozen=True):
    """Each split's shards: a folder of Parquet files of `shard_schema` rows."""

    train: str
    validation: str
    test: str | None = None  # a run's always; a training job of its own may have none


SHARD_COLUMNS = ("row", "label", "input_ids", "token_type_ids")  # the last for pairs only


def shard_schema(targets: Targets, pairs: bool = False) -> pa.Schema:
    """A shard's row: its number in the split, its target (a class id; a multi-hot row or the numbers,
    as floats), its token ids, and for a pair of texts which text each token is of."""
    label = pa.int64() if targets.task == "single_label" else pa.list_(pa.float32())
    types = {"token_type_ids": pa.list_(pa.int8())} if pairs else {}
    return pa.schema({"row": pa.int64(), "label": label, "input_ids": pa.list_(pa.int32())} | types)
