"""Tokenized shards: which pieces of the splits each Ray task tokenizes, and the task itself.

Kept apart from the Prefect task (tasks/tokenize/) on purpose: every Ray worker that tokenizes
imports this module, and leaving Prefect and transformers out of its imports starts each worker
seconds sooner (and ~250 MiB smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel
from tokenizers import Tokenizer

from tasks.contracts.shards import shard_schema
from tasks.core import progress, storage
from tasks.core.data import SPLITS, Schema, Split, labelled_frames
from tasks.core.files import Piece
from tasks.core.text import encoded

SHARD_BYTES = 256 << 20  # the most input one task tokenizes into one Parquet file


class Written(BaseModel):
    """A shard task's running count, tallied on the stage's progress channel after every chunk."""

    rows: int = 0
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


def write_shard(shard: Shard, schema: Schema, tokenizer: Tokenizer, target: str, job: str, channel: str) -> int:
    """One shard's rows, checked and tokenized a chunk (CHUNK_ROWS) at a time, streamed into one
    Parquet file of (row, label, input_ids[, token_type_ids]) under target, a row group per chunk; returns the rows
    written, and tallies them on the channel as it goes. Named by the job (the output folder's record
    of its files) and the shard's number, a retried task overwrites its own file (and its tally)."""
    path, filesystem = storage.pyarrow_filesystem(target)
    pairs = schema.text_pair_column is not None
    rows, me, written = 0, f"{shard.split}-{shard.index:05d}", shard_schema(schema.targets, pairs)
    with pq.ParquetWriter(f"{path}/{job}_{shard.index:05d}.parquet", written, filesystem=filesystem) as out:
        for piece in shard.pieces:
            for frame in labelled_frames(piece.uri, schema, piece=piece):
                ids, types = encoded(tokenizer, frame["text"].tolist(), frame["text_pair"].tolist() if pairs else None)
                row = piece.first_row - piece.file_row + frame.index.to_numpy()  # the file's row -> the split's
                columns = {"row": row, "label": frame["label"].tolist(), "input_ids": ids}
                out.write_table(pa.table(columns | ({"token_type_ids": types} if pairs else {}), schema=written))
                rows += len(frame)
                progress.tally(channel, me, Written(rows=rows))
    progress.tally(channel, me, Written(rows=rows, done=True))
    return rows
