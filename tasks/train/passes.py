"""An epoch's pass over the training split: the whole epoch, from Ray Train's equal split of the stream
(tasks/train/stream.py); or, after a checkpoint taken mid-epoch, the rest of it, at whatever number of
workers the run now has.

Which rows a worker gets of Ray Train's split depends on the number of workers, so a mid-epoch
position counted in micro-batches means nothing at another number. Instead every checkpoint keeps the
keys of the rows the epoch has trained so far (TrainedRows, TRAINED_FILE beside the DeepSpeed state),
and the rest of the epoch is every other row: each worker reads the split's shards itself, in one order
that every worker draws alike (the files in name order, each Parquet batch shuffled with the seed and
the epoch), drops the trained rows and keeps every `world`-th of the others from its rank, with copies
of a row numbered -1 so that every worker has as many. Every row of the epoch is trained once, at any
number of workers; the rest of the epoch is shuffled within a Parquet batch rather than across the split.
Read by hand rather than split by Ray Train: its split cannot leave rows out, and the rows left are
known only from the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset
import torch.distributed as dist

from tasks.contracts.shards import SHARD_COLUMNS
from tasks.core import storage
from tasks.train.batches import rows_of
from tasks.train.ingest import padding_rows

TRAINED_FILE = "trained_rows.npy"  # the keys of the rows the checkpoint's epoch has trained
READ_ROWS = 8192  # rows per Parquet batch read and shuffled
WINDOWS = 2**20  # a window's key: its row's number x WINDOWS + its last starting word + 1


def keys(rows: np.ndarray, words: list | None) -> np.ndarray:
    """Each real row's key (padding, numbered -1, has none): its number in the split, or for a long
    text read in windows (which share their row's number) that and the last word the window starts."""
    real = rows >= 0
    if words is None:
        return rows[real].astype(np.int64)
    last_word = np.array([max(window, default=-1) for window in words], dtype=np.int64)
    return (rows * WINDOWS + last_word + 1)[real]


@dataclass(frozen=True)
class EpochPass:
    """The rows of an epoch a pass trains: all of them, or those after `rows_before`; `batches`
    micro-batches on every worker."""

    rows_before: int
    rows: int  # the split's real rows
    batches: int

    def position(self, done: int) -> float:
        """Epochs' worth of the split trained once `done` micro-batches of this pass are."""
        return (self.rows_before + done / self.batches * (self.rows - self.rows_before)) / self.rows

    @classmethod
    def rest(cls, rows_before: int, rows: int, world: int, micro_batch: int) -> EpochPass:
        return cls(rows_before, rows, math.ceil(math.ceil((rows - rows_before) / world) / micro_batch))


class TrainedRows:
    """The keys of the rows this epoch has trained, on every worker: those before the resume, and this
    worker's since, gathered from every worker at a checkpoint."""

    def __init__(self, before: np.ndarray):
        self.before, self.here = before, []

    def add(self, batch: dict) -> None:
        """A collated micro-batch's rows (host tensors), as trained here."""
        words = [row[row >= 0].tolist() for row in batch["words"].numpy()] if "words" in batch else None
        self.here.append(keys(batch["row"].numpy(), words))

    def gathered(self) -> np.ndarray:
        """Every worker's keys with those before the resume: a collective, every worker calls it."""
        mine = np.concatenate([self.before[:0], *self.here])
        every: list[np.ndarray] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return np.union1d(self.before, np.concatenate(every))


def saved_keys(folder: str) -> np.ndarray:
    """The keys a checkpoint's folder keeps (none before its epoch's first checkpoint)."""
    saved = Path(folder, TRAINED_FILE)
    return np.load(saved) if saved.exists() else np.zeros(0, dtype=np.int64)


def rest_of_epoch(
    uri: str, trained: np.ndarray, the_pass: EpochPass, micro_batch: int, seed: int, epoch: int
) -> Iterator[dict[str, np.ndarray]]:
    """This worker's share of the rows of the split at `uri` not yet trained this epoch, `micro_batch` at
    a time: `the_pass.batches` micro-batches, as on every worker."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path, filesystem = storage.pyarrow_filesystem(uri)
    shards = pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet")
    columns = [name for name in SHARD_COLUMNS if name in shards.schema.names]
    fragments = sorted(shards.get_fragments(), key=lambda fragment: fragment.path)

    def batches(read: list[str]) -> Iterator[pa.RecordBatch]:  # the same cuts whatever the columns read
        return (batch for fragment in fragments for batch in fragment.to_batches(columns=read, batch_size=READ_ROWS))

    keyed = [name for name in ("row", "words") if name in columns]  # a first pass reads the keys alone
    left_rows = [untrained(batch, trained, seed, epoch, index) for index, batch in enumerate(batches(keyed))]
    if (left := sum(map(len, left_rows))) != the_pass.rows - the_pass.rows_before:
        raise RuntimeError(
            f"the checkpoint's epoch has {the_pass.rows - the_pass.rows_before} rows left to train, and its "
            f"record of the rows trained leaves {left}"
        )
    held, seen = [], 0
    for batch, rows in zip(batches(columns), left_rows, strict=True):
        held.append(batch.take(pa.array(rows[(seen + np.arange(len(rows))) % world == rank])))
        seen += len(rows)
        yield from whole_batches(held, micro_batch)
    have = (left - rank + world - 1) // world  # this worker's of them, dealt one each from rank 0
    if have < the_pass.batches * micro_batch:
        held += padding_rows(shards.head(1, columns=columns), the_pass.batches * micro_batch - have).to_batches()
    yield from whole_batches(held, micro_batch, last=True)


def untrained(batch: pa.RecordBatch, trained: np.ndarray, seed: int, epoch: int, index: int) -> np.ndarray:
    """The places of a Parquet batch's rows not trained yet, in an order drawn from (seed, epoch, index)."""
    words = batch.column("words").to_pylist() if "words" in batch.schema.names else None
    left = np.flatnonzero(~np.isin(keys(batch.column("row").to_numpy(), words), trained))
    return left[np.random.default_rng([seed, epoch, index]).permutation(len(left))]


def whole_batches(held: list, micro_batch: int, last: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Micro-batches of the rows held, as Ray Data's numpy batches hold them; what is left stays held
    (or is the last, shorter one)."""
    table = pa.Table.from_batches(held) if held else None
    while table is not None and (table.num_rows >= micro_batch or (last and table.num_rows)):
        first, table = rows_of(table, micro_batch)
        yield first
    held[:] = table.to_batches() if table is not None and table.num_rows else []
