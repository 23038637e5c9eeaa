"""Stage 2's data ingest: each tokenized split as a lazy Ray Data stream of its Parquet shards, and
Ray Train's ingest options (tasks/train/batches.py makes micro-batches of what a worker gets)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.dataset
import ray
from ray.data import DataContext
from ray.train import DataConfig

from tasks.core import storage

# Blocks of the training stream: Ray Data cuts them at 128 MiB, and a shuffle's output blocks are
# large, so a worker waited on a few big reduce tasks: at 1M tiny-model rows, 0.47x the samples/s
# of the in-memory loader, 1.01x with blocks of at most 16 MiB (bench/training_data.py).
BLOCK_BYTES = 16 * 2**20


@contextmanager
def parquet_reader_v1() -> Iterator[None]:
    """Ray Data 2.60 reads Parquet through its datasource V2 unless told otherwise, and V2 lists the
    files in a stage of its own at every pass: a pass over the main job's 8,530 rows took 1.2-2.5 s
    with V2 and 0.07-0.14 s with V1, and training makes a pass per epoch and per validation. The
    choice is taken when the dataset is made, from the process's context: set for that moment only."""
    context = DataContext.get_current()
    v2, context.use_datasource_v2 = context.use_datasource_v2, False
    try:
        yield
    finally:
        context.use_datasource_v2 = v2


def split(uri: str) -> tuple[ray.data.Dataset, int, pa.Table]:
    """A tokenized split as a lazy Ray Data stream of its Parquet shards, with its real row count, from
    the Parquet footers (Ray Data's count() runs a pipeline: 1.8 s of the main job's start, for the same
    8530 rows), and one of its rows, to pad it with (EqualParts)."""
    path, filesystem = storage.pyarrow_filesystem(uri)
    with parquet_reader_v1():
        rows = ray.data.read_parquet(path, filesystem=filesystem, file_extensions=["parquet"])
    rows.context.target_max_block_size = BLOCK_BYTES  # this stream's context: the read and the shuffle after it
    shards = pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet")
    return rows, shards.count_rows(), shards.head(1)


def padding_rows(row: pa.Table, count: int) -> pa.Table:
    """`count` copies of a one-row table, numbered -1."""
    copies = pa.concat_tables([row] * count)
    return copies.set_column(copies.schema.get_field_index("row"), "row", pa.array([-1] * count, pa.int64()))


class EqualParts(DataConfig):
    """Ray Train's ingest with the blocks kept in order, so that the split each worker gets, and so the
    order of every epoch, follows from the seed alone (Ray hands blocks out as they come); the training
    split padded with copies of a row numbered -1, which count for nothing (tasks/core/objective.py), to
    a multiple of the workers: Ray Train's equal split would otherwise drop the remainder, and an unequal
    one leaves a worker's collectives waiting. Padded here, where Ray Train splits it for each worker
    group, because a range of num_workers starts groups of several sizes."""

    def __init__(self, rows: int, row: pa.Table):
        options = DataConfig.default_ingest_options()
        options.preserve_order = True
        super().__init__(execution_options=options)
        self.rows, self.row = rows, row

    def configure(self, datasets: dict, world_size: int, *args, **kwargs) -> list[dict]:
        if padding := -self.rows % world_size:
            datasets = {
                name: rows.union(ray.data.from_arrow(padding_rows(self.row, padding)))
                for name, rows in datasets.items()
            }
        return super().configure(datasets, world_size, *args, **kwargs)
