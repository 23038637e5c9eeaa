"""A training worker's micro-batches of the tokenized splits.

What a worker sees of the data: Ray Data streams the training split from its Parquet shards, and Ray
Train splits the stream into equal parts, one per worker (`get_dataset_shard`). The driver pads it
with fewer copies of a row numbered -1 than there are workers, so the equal split drops no row and every worker
runs the same number of micro-batches. An evaluation split (validation, test) every worker reads
from its shards itself, keeping its own rows, padded the same way (`own_rows`). The training split
is shuffled once by Ray Data with the seed (the same permutation every epoch), then within a buffer
of `shuffle_buffer_rows` rows with a seed of (seed, epoch, worker): the order of every epoch follows
from the seed alone. Rows are then drawn `length_group_batches` micro-batches at a time, sorted by
length, cut into micro-batches and trained in a seeded random order (most of a batch's padding was
compute spent on nothing). A worker holds its group, `prefetch_batches` more and the shuffle buffer,
whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.dataset
import ray.train
import torch

from tasks.contracts.shards import SHARD_COLUMNS
from tasks.core import storage
from tasks.core.tagging import IGNORED
from tasks.core.text import padded
from tasks.core.train_config import TrainConfig
from tasks.train.ingest import padding_rows


def collate(batch: dict[str, np.ndarray], pad_id: int, pin: bool) -> dict[str, torch.Tensor]:
    """A Ray Data batch of tokenized rows -> padded host tensors (row numbers kept, for validation),
    in page-locked memory for a GPU, so that their copy to it runs beside the compute."""
    rows = list(batch["input_ids"])
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    input_ids, attention_mask = padded(rows, lengths, pad_id)
    tagged = "words" in batch  # token_classification: a label per token
    labels = padded(list(batch["label"]), lengths, IGNORED)[0] if tagged else targets_of(batch["label"])
    host = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.from_numpy(labels),
        "row": torch.tensor(batch["row"], device="cpu"),
    }  # copies: Ray's arrays are read-only
    if "token_type_ids" in batch:  # a pair of texts: which one each token is of
        host["token_type_ids"] = torch.from_numpy(padded(list(batch["token_type_ids"]), lengths, 0)[0])
    if tagged:  # the word each token starts, for evaluation (tasks/train/evaluation.py)
        host["words"] = torch.from_numpy(padded(list(batch["words"]), lengths, -1)[0])
    pinned = {key: tensor.pin_memory() for key, tensor in host.items()} if pin else host
    return pinned | ({"tags": [np.asarray(tags).tolist() for tags in batch["tags"]]} if tagged else {})


def targets_of(column: np.ndarray) -> np.ndarray:
    """A batch's targets as one array: class ids, or a row of floats per row (multi-label, regression),
    which Ray Data and pyarrow hand over as an array of arrays. A copy: Ray's arrays are read-only."""
    return np.stack(column) if column.dtype == object else np.array(column)


def by_length(group: list[dict[str, np.ndarray]], pad_id: int, pin: bool) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of rows -> as many micro-batches of the same sizes, of the same rows sorted by
    length (shortest first), each padded to its own longest row."""
    rows = {key: np.concatenate([batch[key] for batch in group]) for key in group[0]}
    order = np.argsort(np.fromiter(map(len, rows["input_ids"]), np.int64, len(rows["input_ids"])), kind="stable")
    ends = np.cumsum([len(batch["row"]) for batch in group])
    return [
        collate({key: column[part] for key, column in rows.items()}, pad_id, pin) for part in np.split(order, ends[:-1])
    ]


def training_batches(
    drawn: Iterator[dict[str, np.ndarray]], cfg: TrainConfig, pad_id: int, epoch: int, *, pin: bool = False
):
    """This worker's micro-batches of the training split for one epoch (`drawn`: its rows, from
    tasks/train/stream.py), `length_group_batches` at a time grouped by length: each group's batches in
    an order drawn from (seed, epoch) alone, the same on every worker, so the workers' batches at one
    step are of like width (a step waits for its slowest worker)."""
    yield from grouped(drawn, cfg, pad_id, pin, np.random.default_rng([cfg.seed, epoch]))


def evaluation_batches(split: str, micro_batch: int, cfg: TrainConfig, pad_id: int, *, pin: bool = False):
    """This worker's micro-batches of an evaluation split for one pass, grouped by length as training's."""
    yield from grouped(own_rows(split, micro_batch), cfg, pad_id, pin, None)


def grouped(drawn, cfg: TrainConfig, pad_id: int, pin: bool, order: np.random.Generator | None):
    # Grouped here rather than by asking Ray for batches of the group's size: its shuffle buffer then
    # yielded a short batch mid-stream (22 micro-batches on one worker, 21 on the others).
    drawn = iter(drawn)
    for group in iter(lambda: list(islice(drawn, cfg.length_group_batches)), []):
        grouped = by_length(group, pad_id, pin)  # every worker draws as many micro-batches, so as many per group
        yield from grouped if order is None else (grouped[i] for i in order.permutation(len(grouped)))


def own_rows(split: str, micro_batch: int) -> Iterator[dict[str, np.ndarray]]:
    """This worker's rows of an evaluation split, `micro_batch` at a time: those whose number is its rank
    modulo the workers (a long text's windows share their row's number, so they stay together), and
    copies of a row numbered -1 (they count for nothing) up to the most any worker has, so every worker
    has as many rows: under ZeRO-3 each forward pass is a collective. Read from the shards here rather
    than split by Ray Train: that started a coordinator actor per split, a process (1.5-3 s here) for
    rows each worker reads once per evaluation."""
    context = ray.train.get_context()
    rank, workers = context.get_world_rank(), context.get_world_size()
    path, filesystem = storage.pyarrow_filesystem(split)
    shards = pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet")
    columns = [name for name in SHARD_COLUMNS if name in shards.schema.names]
    held: list[pa.RecordBatch] = []
    for batch in shards.to_batches(columns=columns):
        held.append(batch.filter(pa.array(batch.column("row").to_numpy() % workers == rank)))
        while sum(map(len, held)) >= micro_batch:
            first, rest = rows_of(pa.Table.from_batches(held), micro_batch)
            yield first
            held = rest.to_batches()
    shares = np.bincount(shards.to_table(columns=["row"]).column("row").to_numpy() % workers, minlength=workers)
    if shares[rank] < shares.max():
        held += padding_rows(shards.head(1, columns=columns), int(shares.max() - shares[rank])).to_batches()
    while sum(map(len, held)):
        first, rest = rows_of(pa.Table.from_batches(held), micro_batch)
        yield first
        held = rest.to_batches()


def rows_of(table: pa.Table, count: int) -> tuple[dict[str, np.ndarray], pa.Table]:
    """The first `count` rows of a table as a Ray Data numpy batch would hold them, and the rest."""
    first = table.slice(0, count)
    return {name: first.column(name).to_numpy() for name in table.column_names}, table.slice(count)
