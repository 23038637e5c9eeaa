"""A training worker's micro-batches of its shard of the streamed tokenized splits.

What a worker sees of the data: Ray Data streams each split from its Parquet shards, and Ray Train
splits the stream into equal parts, one per worker (`get_dataset_shard`). The driver pads each split
with fewer ignored rows than there are workers, so the equal split drops no row and every worker
runs the same number of micro-batches. The training split is shuffled once by Ray Data with the
seed (the same permutation every epoch), then within a buffer of `shuffle_buffer_rows` rows with a
seed of (seed, epoch, worker): the order of every epoch follows from the seed alone. Rows are then
drawn `length_group_batches` micro-batches at a time, sorted by length, cut into micro-batches and
trained in a seeded random order (most of a batch's padding was compute spent on nothing). A worker
holds its group, `prefetch_batches` more and the shuffle buffer, whatever the corpus size.
"""

from __future__ import annotations

from itertools import islice

import numpy as np
import ray.train
import torch

from tasks.core.config import TrainConfig
from tasks.core.text import padded


def collate(batch: dict[str, np.ndarray], pad_id: int, pin: bool) -> dict[str, torch.Tensor]:
    """A Ray Data batch of tokenized rows -> padded host tensors (row numbers kept, for validation),
    in page-locked memory for a GPU, so that their copy to it runs beside the compute."""
    rows = list(batch["input_ids"])
    input_ids, attention_mask = padded(rows, np.fromiter(map(len, rows), np.int64, len(rows)), pad_id)
    host = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.tensor(batch["label"], device="cpu"),
        "row": torch.tensor(batch["row"], device="cpu"),
    }  # copies: Ray's arrays are read-only
    return {key: tensor.pin_memory() for key, tensor in host.items()} if pin else host


def by_length(group: list[dict[str, np.ndarray]], pad_id: int, pin: bool) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of rows -> as many micro-batches of the same sizes, of the same rows sorted by
    length (shortest first), each padded to its own longest row."""
    rows = {key: np.concatenate([batch[key] for batch in group]) for key in group[0]}
    order = np.argsort(np.fromiter(map(len, rows["input_ids"]), np.int64, len(rows["input_ids"])), kind="stable")
    ends = np.cumsum([len(batch["row"]) for batch in group])
    return [
        collate({key: column[part] for key, column in rows.items()}, pad_id, pin) for part in np.split(order, ends[:-1])
    ]


def batches(
    split: str, micro_batch: int, cfg: TrainConfig, pad_id: int, epoch: int | None = None, *, pin: bool = False
):
    """This worker's micro-batches of a split for one pass, `length_group_batches` at a time grouped by
    length. For an epoch of training, rows come from a seeded shuffle buffer and each group's batches
    go in an order drawn from (seed, epoch) alone: the same on every worker, so the workers' batches
    at one step are of like width (a step waits for its slowest worker)."""
    rank = ray.train.get_context().get_world_rank()
    shuffle = (
        {}
        if epoch is None
        else {
            "local_shuffle_buffer_size": cfg.shuffle_buffer_rows,
            "local_shuffle_seed": hash((cfg.seed, epoch, rank)) % 2**32,
        }
    )
    order = None if epoch is None else np.random.default_rng([cfg.seed, epoch])
    drawn = iter(
        ray.train.get_dataset_shard(split).iter_batches(
            batch_size=micro_batch, batch_format="numpy", prefetch_batches=cfg.prefetch_batches, **shuffle
        )
    )
    # Grouped here rather than by asking Ray for batches of the group's size: its shuffle buffer then
    # yielded a short batch mid-stream (22 micro-batches on one worker, 21 on the others).
    for group in iter(lambda: list(islice(drawn, cfg.length_group_batches)), []):
        grouped = by_length(group, pad_id, pin)  # every worker draws as many micro-batches, so as many per group
        yield from grouped if order is None else (grouped[i] for i in order.permutation(len(grouped)))
