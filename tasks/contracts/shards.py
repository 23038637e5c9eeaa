"""What tokenization hands on: each split's shards, Parquet files of `shard_schema` rows under
<root>/tokenized/<content-key>/<split>/ (tasks/core/layout.py), which training reads."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset
from pydantic import BaseModel

from tasks.core import storage
from tasks.core.tagging import IGNORED
from tasks.core.targets import Targets

__all__ = ["IGNORED", "SHARD_COLUMNS", "TokenizedSplits", "shard_schema"]


class TokenizedSplits(BaseModel, frozen=True):
    """Each split's shards: a folder of Parquet files of `shard_schema` rows."""

    train: str
    validation: str
    test: str | None = None  # a run's always; a training job of its own may have none

    def rows(self) -> dict[str, int]:
        """Each split's shard rows, from their Parquet footers: a row per text, or per window of a text
        longer than the model reads (token_classification)."""
        return {name: shard_rows(uri) for name, uri in self if uri}


def shard_rows(uri: str) -> int:
    path, filesystem = storage.pyarrow_filesystem(uri)
    return pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet").count_rows()


# token_type_ids for pairs only; words and tags for token_classification only
SHARD_COLUMNS = ("row", "label", "input_ids", "token_type_ids", "words", "tags")


def shard_schema(targets: Targets, pairs: bool = False) -> pa.Schema:
    """A shard's row: its number in the split, its target (a class id; a multi-hot row or the numbers,
    as floats), its token ids, and for a pair of texts which text each token is of.

    token_classification: a row per window of a text (one where it fits, several sharing its number
    where it is longer than the model's length): each token's tag id (IGNORED where it counts for no
    loss), the word each token is the first sub-token of (-1: none), and the row's tags, one per word."""
    if targets.task == "token_classification":
        tokens = {"label": pa.list_(pa.int16()), "input_ids": pa.list_(pa.int32()), "words": pa.list_(pa.int32())}
        return pa.schema({"row": pa.int64()} | tokens | {"tags": pa.list_(pa.int16())})
    label = pa.int64() if targets.task == "single_label" else pa.list_(pa.float32())
    types = {"token_type_ids": pa.list_(pa.int8())} if pairs else {}
    return pa.schema({"row": pa.int64(), "label": label, "input_ids": pa.list_(pa.int32())} | types)
