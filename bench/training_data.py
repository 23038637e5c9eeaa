"""Training-data benchmark: memory per training worker and samples/s as the corpus grows, streamed
(ftflow: Ray Data, `get_dataset_shard`) against the in-memory loader ftflow had before (every row of
the worker's shard in a Python list), in the same run.

    python bench/training_data.py [--rows 10000 1000000] [--steps 150] [--model PATH] [--main-job]

Each size is the shipped training reviews, tokenized by ftflow's own stage and repeated (with new
row numbers) into Parquet shards of 10,000-row row groups, as the tokenize stage writes them; every
run trains `--steps` optimizer steps (`max_steps`) of global batch 32 on 2 workers. Per run: peak
RSS per training worker (the largest over workers), less the object store's shared pages it maps
(`private_peak_mb`), and steady-state samples/s. `--main-job` adds
the main job's own setting (all-MiniLM-L6-v2 on the shipped 8,530 reviews) for the samples/s ratio.
Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_model import make_tiny_bert  # noqa: E402

import tasks.train.driver  # noqa: E402
from tasks.contracts.shards import TokenizedSplits, shard_schema  # noqa: E402
from tasks.contracts.training import TrainingJob  # noqa: E402
from tasks.core import cluster  # noqa: E402
from tasks.core.config import DataConfig, ModelConfig  # noqa: E402
from tasks.core.data import load_splits  # noqa: E402
from tasks.core.layout import RunStore  # noqa: E402
from tasks.core.train_config import TrainConfig  # noqa: E402
from tasks.tokenize.driver import tokenize_key  # noqa: E402
from tasks.tokenize.task import tokenize  # noqa: E402
from tasks.train.task import train  # noqa: E402

GROUP_ROWS = 10_000


def private_peak_mb(device) -> float:
    """Peak RSS less the object store's shared-memory pages the worker has mapped (RssShmem, read at
    the end): those pages are the node's object store, capped by its object_store_memory and shared
    by every process on the node, and grow with the corpus until the store recycles them (1M rows:
    ~72 MiB of a worker's RSS, against ~1 MiB at 10k); its private memory is what streaming bounds."""
    import torch
    import torch.distributed as dist

    status = {
        line.split(":")[0]: int(line.split()[1])
        for line in open("/proc/self/status")
        if line.startswith(("VmHWM", "RssShmem"))
    }
    worst = torch.tensor([(status["VmHWM"] - status["RssShmem"]) / 2**10], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def streamed_worker(spec) -> None:
    import tasks.train.worker as worker

    worker.peak_memory_mb = private_peak_mb
    worker.train_worker(spec)


def in_memory_worker(spec) -> None:
    """ftflow's worker with the loader it had before streaming: the worker's whole shard read into
    a Python list on first use, then shuffled by (seed, epoch) and cut into micro-batches."""
    import ray.train

    import tasks.train.worker as worker
    from tasks.train.batches import collate

    worker.peak_memory_mb = private_peak_mb
    held: dict[str, list[dict]] = {}

    def batches(split: str, micro_batch: int, cfg: TrainConfig, pad_id: int, epoch: int | None = None):
        if split not in held:
            held[split] = list(ray.train.get_dataset_shard(split).iter_rows())
        rows = held[split]
        order = (
            np.random.default_rng((cfg.seed, epoch)).permutation(len(rows)) if epoch is not None else range(len(rows))
        )
        order = list(order)
        for start in range(0, len(rows), micro_batch):
            chunk = [rows[i] for i in order[start : start + micro_batch]]
            yield collate(
                {
                    "input_ids": [r["input_ids"] for r in chunk],
                    "label": np.array([r["label"] for r in chunk]),
                    "row": np.array([r["row"] for r in chunk]),
                },
                pad_id,
                pin=False,
            )

    worker.batches = batches
    worker.train_worker(spec)


def corpus(tokenized: TokenizedSplits, rows: int, folder: Path) -> TokenizedSplits:
    """The tokenized training split repeated to `rows` rows, in row groups of GROUP_ROWS."""
    base = pq.read_table(tokenized.train).sort_by("row")
    target = folder / f"train-{rows}"
    target.mkdir(parents=True)
    schema = shard_schema(DataConfig().targets)
    with pq.ParquetWriter(target / "bench_00000.parquet", schema) as out:
        for start in range(0, rows, GROUP_ROWS):
            count = min(GROUP_ROWS, rows - start)
            picked = base.take(np.arange(start, start + count) % base.num_rows)
            out.write_table(
                pa.table(
                    {
                        "row": np.arange(start, start + count),
                        "label": picked["label"],
                        "input_ids": picked["input_ids"],
                    },
                    schema=schema,
                )
            )
    return TokenizedSplits(train=str(target), validation=tokenized.validation)


def run(shards: TokenizedSplits, model: str, max_length: int, steps: int, streamed: bool, folder: str) -> dict:
    tasks.train.driver.train_worker = streamed_worker if streamed else in_memory_worker
    # Batches as drawn on both sides: this compares the loaders, not length grouping (bench/strategies.py).
    cfg = TrainConfig(batch_size=32, num_workers=2, max_steps=steps, eval_every_steps=0, length_group_batches=1)
    started = time.perf_counter()
    model_config = ModelConfig(name_or_path=model, max_length=max_length)
    job = TrainingJob(
        shards=shards, model=model_config, targets=DataConfig().targets, train=cfg, store=RunStore.at(folder)
    )
    row = train.fn(job).history[-1]
    return {
        "samples_per_s": row.samples_per_s,
        "peak_memory_mb": row.peak_memory_mb,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--main-job", action="store_true", help="also all-MiniLM-L6-v2 on the shipped reviews")
    args = parser.parse_args()

    from prefect.logging import disable_run_logger

    cluster.connect()
    results = {}
    with tempfile.TemporaryDirectory() as tmp, disable_run_logger():
        tiny = str(make_tiny_bert(Path(tmp) / "tiny"))
        splits = load_splits(DataConfig())
        cases = {}
        for model, max_length in [(tiny, 64)] + ([(ModelConfig().name_or_path, 128)] if args.main_job else []):
            tokenized = tokenize.fn(tokenize_key(splits, model, max_length, tmp), splits, model)
            if model == tiny:
                cases |= {
                    (f"tiny, {rows:,} rows", model, max_length): corpus(tokenized, rows, Path(tmp))
                    for rows in args.rows
                }
            else:
                cases[("all-MiniLM-L6-v2, the main job's 8,530 rows", model, max_length)] = tokenized
        for (name, model, max_length), uris in cases.items():
            for streamed in (True, False):
                label = f"{name}, {'streamed' if streamed else 'in memory'}"
                results[label] = run(uris, model, max_length, args.steps, streamed, f"{tmp}/runs/{len(results)}")
                print(f"RESULT {label}: {json.dumps(results[label])}", flush=True)
    print(f"\n2 workers x 1 CPU, global batch 32, {args.steps} steps per run\n")
    print(
        "| data | loader | samples/s | vs in memory | peak RSS per worker, less object-store pages | vs in memory | wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, r in results.items():
        name, loader = label.rsplit(", ", 1)
        base = results[f"{name}, in memory"]
        print(
            f"| {name} | {loader} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base['samples_per_s']:.2f} "
            f"| {r['peak_memory_mb']:,.0f} MiB | {r['peak_memory_mb'] / base['peak_memory_mb']:.2f} | {r['wall_s']:.0f} s |"
        )
    streamed = [r for label, r in results.items() if label.startswith("tiny") and label.endswith("streamed")]
    if len(streamed) > 1:
        print(
            f"\nstreamed, peak RSS per worker (less object-store pages) at the largest size / the smallest: "
            f"{streamed[-1]['peak_memory_mb'] / streamed[0]['peak_memory_mb']:.3f}"
        )


if __name__ == "__main__":
    main()
