"""Tokenized shards: which pieces of the splits each Ray task tokenizes, and the task itself.

Kept apart from the Prefect task (tasks/tokenize/) on purpose: every Ray worker that tokenizes
imports this module, and leaving Prefect and transformers out of its imports starts each worker
seconds sooner (and ~250 MiB smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel
from tokenizers import Tokenizer

from tasks.contracts.shards import shard_schema
from tasks.core import progress, storage
from tasks.core.data import SPLITS, Schema, Split, labelled_frames
from tasks.core.files import Piece
from tasks.core.tagging import IGNORED, inside_ids, token_labels
from tasks.core.text import encoded, first_subtokens, windows

SHARD_BYTES = 256 << 20  # the most input one task tokenizes into one Parquet file


class Written(BaseModel):
    """A shard task's running count, tallied on the stage's progress channel after every chunk: rows,
    and the windows a long text takes (token_classification; one per row otherwise)."""

    rows: int = 0
    windows: int = 0
    done: bool = False


@dataclass(frozen=True)
class Shard:
    """One task's work: consecutive pieces of one split, tokenized into one Parquet file."""

    split: str
    index: int
    pieces: tuple[Piece, ...]


def shards(splits: dict[str, Split], cpus: int) -> list[Shard]:
    """Each split's pieces in runs of consecutive pieces of about equal bytes: as many runs as CPUs
    (each task costs Ray ~0.2 s here, so a small corpus gets no more tasks than it can run at once),
    more when runs would exceed SHARD_BYTES (a retried task redoes at most that much)."""
    found = []
    for name in SPLITS:
        pieces = splits[name].pieces
        sizes = [max(1, piece.size) for piece in pieces]
        total, count = sum(sizes), min(len(pieces), max(cpus, -(-sum(sizes) // SHARD_BYTES)))
        before = list(accumulate(sizes, initial=0))
        # Each piece goes to the run its middle byte falls in: runs stay contiguous and balanced.
        runs = [min(count - 1, (before[i] + sizes[i] // 2) * count // total) for i in range(len(pieces))]
        found += [
            Shard(name, run, tuple(p for p, r in zip(pieces, runs, strict=True) if r == run))
            for run in sorted(set(runs))
        ]
    return found


def write_shard(shard: Shard, schema: Schema, tokenizer: Tokenizer, target: str, job: str, channel: str) -> Written:
    """One shard's rows, checked and tokenized a chunk (CHUNK_ROWS) at a time, streamed into one
    Parquet file of `shard_schema` rows under target, a row group per chunk; returns the rows and
    windows written, and tallies them on the channel as it goes. Named by the job (the output folder's
    record of its files) and the shard's number, a retried task overwrites its own file (and its tally)."""
    path, filesystem = storage.pyarrow_filesystem(target)
    me, written = f"{shard.split}-{shard.index:05d}", Written()
    columns_of = tagged_columns if schema.tagged else text_columns
    with pq.ParquetWriter(
        f"{path}/{job}_{shard.index:05d}.parquet",
        shard_schema(schema.targets, schema.text_pair_column is not None),
        filesystem=filesystem,
    ) as out:
        for piece in shard.pieces:
            for frame in labelled_frames(piece.uri, schema, piece=piece):
                row = piece.first_row - piece.file_row + frame.index.to_numpy()  # the file's row -> the split's
                table = pa.table(columns_of(tokenizer, frame, row, schema), schema=out.schema)
                out.write_table(table)
                written = Written(rows=written.rows + len(frame), windows=written.windows + len(table))
                progress.tally(channel, me, written)
    written = written.model_copy(update={"done": True})
    progress.tally(channel, me, written)
    return written


def text_columns(tokenizer: Tokenizer, frame: pd.DataFrame, row: np.ndarray, schema: Schema) -> dict:
    """A chunk's texts (or pairs of texts) as their token ids, with their targets."""
    pairs = schema.text_pair_column is not None
    ids, types = encoded(tokenizer, frame["text"].tolist(), frame["text_pair"].tolist() if pairs else None)
    return {"row": row, "label": frame["label"].tolist(), "input_ids": ids} | (
        {"token_type_ids": types} if pairs else {}
    )


def tagged_columns(tokenizer: Tokenizer, frame: pd.DataFrame, row: np.ndarray, schema: Schema) -> dict:
    """A chunk's words (token_classification) as the windows of their token ids, each token's label, the
    word each token starts, and the row's tags (tasks/contracts/shards.py)."""
    inside = inside_ids(schema.label_names) if schema.subtokens == "all" else None
    columns = {name: [] for name in ("row", "label", "input_ids", "words", "tags")}
    for number, tags, encodings in zip(row, frame["label"], windows(tokenizer, frame["text"].tolist()), strict=True):
        for encoding in encodings:
            starts = first_subtokens(encoding)
            columns["row"].append(number)
            columns["label"].append(token_labels(encoding.word_ids, starts, tags, inside, IGNORED))
            columns["input_ids"].append(encoding.ids)
            columns["words"].append(starts)
            columns["tags"].append(tags)
    return columns
