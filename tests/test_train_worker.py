"""The training workers' data: every row once per epoch, equal shards, a seeded order that changes per
epoch, batches grouped by length; and a diverged loss stops training where it is read."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.train
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from tasks.contracts.shards import shard_schema
from tasks.core.targets import Targets
from tasks.core.train_config import TrainConfig
from tasks.train.batches import training_batches
from tasks.train.ingest import EqualParts, split
from tasks.train.stream import drawn
from tasks.train.worker import Meter


def test_every_worker_gets_equal_micro_batches_and_every_row_once_per_epoch(ray_cluster, tmp_path):
    rows = 1000  # 3 workers: two copies of a row, numbered -1, pad it to 1002
    folder = tmp_path / "tokenized" / "train"
    folder.mkdir(parents=True)
    for part in range(3):  # three shards, sorted by label as the shipped reviews are
        numbers = list(range(part * rows // 3, (part + 1) * rows // 3))
        pq.write_table(
            pa.table(
                {
                    "row": numbers,
                    "label": [int(n >= rows // 2) for n in numbers],
                    "input_ids": [[5] * (1 + n % 7) for n in numbers],
                },
                schema=shard_schema(Targets(names=("negative", "positive"))),
            ),
            folder / f"job_{part:05d}.parquet",
        )
    seen = tmp_path / "seen"
    seen.mkdir()

    def record(config: dict) -> None:
        cfg, rank = (
            TrainConfig(shuffle_buffer_rows=64, length_group_batches=4),
            ray.train.get_context().get_world_rank(),
        )
        epochs = [
            [
                {key: batch[key].tolist() for key in ("row", "labels", "attention_mask")}
                for batch in training_batches(drawn(16, cfg, epoch), cfg, 0, epoch)
            ]
            for epoch in range(2)
        ]
        (seen / f"{rank}.json").write_text(json.dumps(epochs))

    stream, count, a_row = split(str(folder))
    TorchTrainer(
        record,
        datasets={"train": stream.random_shuffle(seed=7)},
        dataset_config=EqualParts(count, a_row),
        scaling_config=ScalingConfig(num_workers=3, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(tmp_path / "ray")),
    ).fit()

    workers = [json.loads((seen / f"{rank}.json").read_text()) for rank in range(3)]
    assert count == rows
    for epoch in range(2):
        shards = [[row for batch in worker[epoch] for row in batch["row"]] for worker in workers]
        assert [len(worker[epoch]) for worker in workers] == [
            21,
            21,
            21,
        ]  # 1002 / 3 = 334 rows each, in micro-batches of 16
        assert sorted(row for shard in shards for row in shard) == [-1, -1, *range(rows)]
        first_batch = workers[0][epoch][0]["labels"]
        assert 0 < sum(first_batch) < len(first_batch), "a micro-batch of one class: the split was not shuffled"
    assert workers[0][0][0]["row"] != workers[0][1][0]["row"], "both epochs in the same order"

    # Length grouping: rows of 1-7 tokens, drawn 4 micro-batches at a time and sorted by length,
    # pad little (83% of the computed tokens real; random batches of 16: ~58%); the batches of a group go in a
    # random order, the same on every worker, so a step's batches are of like width.
    widths = [[len(batch["attention_mask"][0]) for batch in worker[0]] for worker in workers]
    real = sum(sum(map(sum, batch["attention_mask"])) for worker in workers for batch in worker[0])
    computed = sum(
        len(batch["attention_mask"]) * len(batch["attention_mask"][0]) for worker in workers for batch in worker[0]
    )
    assert real / computed > 0.75, f"only {real / computed:.0%} of the computed tokens are real"
    groups = [widths[0][start : start + 4] for start in range(0, 20, 4)]
    assert any(group != sorted(group) for group in groups), (
        f"each group trains shortest first, in no drawn order: {groups}"
    )
    assert sum(max(step) - min(step) for step in zip(*widths, strict=True)) <= len(widths[0]), widths


def test_a_loss_no_longer_finite_stops_training_at_its_next_log(tmp_path):
    """bf16 trains without DeepSpeed's per-step overflow check (tasks/train/deepspeed_json.py): a diverged
    run fails in one line where its loss is read, rather than exporting a model of NaNs."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        meter, labels = Meter(torch.device("cpu"), "single_label"), torch.tensor([0, 1])
        meter.add(torch.tensor(0.7), torch.zeros(2, 2), labels, labels)
        assert meter.point(20, 0.25).loss == pytest.approx(0.7)
        meter.add(torch.tensor(float("nan")), torch.zeros(2, 2), labels, labels)
        with pytest.raises(FloatingPointError, match=r"^training diverged: the training loss is nan by step 40 "):
            meter.point(40, 0.5)
    finally:
        dist.destroy_process_group()
