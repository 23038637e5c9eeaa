"""A training worker's stream of the training split's rows, as Ray Data batches, and the first epoch's
stream started before the worker's heavy imports.

Ray Data's first batch comes through new processes started one after another (its split coordinator,
its stats actor, a read task's worker): 4.1-4.4 s here on a 2-core CPU, and until now after the
worker had imported torch, transformers and DeepSpeed and built its engine (another 6-8 s on one
core). Started first, in a thread, those processes boot on the other core while this one imports.
This module imports Ray and numpy only, so that the worker's entry point can start it first.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain

import numpy as np
import ray.train

from tasks.core.train_config import TrainConfig


def drawn(micro_batch: int, cfg: TrainConfig, epoch: int) -> Iterator[dict[str, np.ndarray]]:
    """This worker's rows of the training split for one epoch, `micro_batch` at a time: Ray Train's
    equal part of the split, from a seeded shuffle buffer (the order follows from the seed alone)."""
    rank = ray.train.get_context().get_world_rank()
    return iter(
        ray.train.get_dataset_shard("train").iter_batches(
            batch_size=micro_batch,
            batch_format="numpy",
            prefetch_batches=cfg.prefetch_batches,
            local_shuffle_buffer_size=cfg.shuffle_buffer_rows,
            local_shuffle_seed=hash((cfg.seed, epoch, rank)) % 2**32,
        )
    )


def first_epoch_started(micro_batch: int, cfg: TrainConfig) -> Future[Iterator[dict[str, np.ndarray]]] | None:
    """The first epoch's rows with their first batch drawn in a thread, from now; None where the
    worker resumes from a checkpoint (it knows its epoch only once the checkpoint is loaded)."""
    if ray.train.get_checkpoint() is not None:
        return None

    def first() -> Iterator[dict[str, np.ndarray]]:
        rows = drawn(micro_batch, cfg, 0)
        return chain([next(rows)], rows)

    pool = ThreadPoolExecutor(1, thread_name_prefix="first-batch")
    started = pool.submit(first)
    pool.shutdown(wait=False)  # the thread ends with its one call
    return started
