"""Strategy benchmark: one model, one dataset, one global batch, trained every way ftflow offers.

    python bench/strategies.py [--rows 960] [--batch-size 32] [--workers 2] [--cpus-per-worker 1]
                               [--model PATH] [--only NAME ...]

Baselines, measured in the same run on the same tokenized rows:
  * `pytorch`: a bare single-process PyTorch loop (torch.optim.AdamW as most hand-written loops
    create it, all of the machine's CPUs), and the same loop with `fused=True`;
  * `hf trainer`: the Hugging Face Trainer in one process (its defaults: fused AdamW on this torch),
    with random batches and with `train_sampling_strategy="group_by_length"` (transformers 5's name
    for `group_by_length=True`);
  * `ray train ddp`: Ray Train with torch DistributedDataParallel and no DeepSpeed.
Then ftflow's training task (DeepSpeed): the default (ZeRO 0, length-grouped batches, its default
layout: one worker with every CPU on one machine; `--workers` x `--cpus-per-worker` override it),
the same without length grouping and as 2 workers x 1 thread, ZeRO 1, 2, 3 and 3 + parameter and
optimizer offload on 2 workers, tensor parallelism over 2 workers and 2 pipeline stages.
Every strategy trains on the same rows with the same
global batch and recipe, in its own seeded order (the loops: DistributedSampler, seed 42), pads each
batch to its longest row, and checkpoints once half-way so the checkpoint's cost is measured too.

Per strategy: steady-state samples/s (after the first batch, checkpoint excluded), its ratio to the
bare loop, peak memory per worker (resident set on CPU, allocated on GPU), seconds from the training
function's start (model load, engine build) to the end of the first step, seconds per checkpoint, and
the whole wall time (Ray worker start-up, and for ftflow validation and model export, included).
Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.contracts.shards import TokenizedSplits  # noqa: E402
from tasks.contracts.training import TrainingJob  # noqa: E402
from tasks.core import cluster  # noqa: E402
from tasks.core.config import DataConfig, ModelConfig  # noqa: E402
from tasks.core.data import load_splits  # noqa: E402
from tasks.core.layout import RunStore  # noqa: E402
from tasks.core.train_config import TrainConfig  # noqa: E402
from tasks.tokenize.driver import tokenize_key  # noqa: E402
from tasks.tokenize.task import tokenize  # noqa: E402
from tasks.train.batches import collate  # noqa: E402
from tasks.train.engine import param_groups  # noqa: E402
from tasks.train.task import train  # noqa: E402

LABELS = ["negative", "positive"]
LEARNING_RATE = 1e-4  # every row alike: the speed compared does not depend on it
DEEPSPEED = {
    "zero0 (default)": {"zero_stage": 0},
    "zero0, no length grouping": {"zero_stage": 0, "length_group_batches": 1},
    "zero0, 2 workers x 1 thread": {"zero_stage": 0, "num_workers": 2, "cpus_per_worker": 1},
    # ZeRO shards across workers: one worker would have nothing to shard.
    "zero1": {"zero_stage": 1, "num_workers": 2},
    "zero2": {"zero_stage": 2, "num_workers": 2},
    "zero3": {"zero_stage": 3, "num_workers": 2},
    "zero3 + offload": {"zero_stage": 3, "num_workers": 2, "offload_params": True, "offload_optimizer": True},
    # The model split in two: every layer's matrices (tensor parallel), or its layers in 2 stages, fed
    # one micro-batch per step, and 4 (micro-batches of 4 rows per worker) so that the stages overlap.
    "tp2": {"tensor_parallel_size": 2, "num_workers": 2},
    "pp2": {"pipeline_parallel_size": 2, "num_workers": 2},
    "pp2, 4 micro-batches": {"pipeline_parallel_size": 2, "num_workers": 2, "micro_batch_size": 4},
}


def read_tokenized(uri: str) -> list[dict]:
    """The baselines' in-memory loader: every row of the split in a Python list."""
    return pq.read_table(uri).sort_by("row").select(["row", "input_ids", "label"]).to_pylist()


def collate_rows(pad_id: int) -> Callable[[list[dict]], dict]:
    def pad(rows: list[dict]) -> dict:
        batch = collate(
            {
                "input_ids": [r["input_ids"] for r in rows],
                "label": np.array([r["label"] for r in rows]),
                "row": np.array([r["row"] for r in rows]),
            },
            pad_id,
        )
        return {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}

    return pad


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def hand_written_loop(
    model_path: str,
    rows: list[dict],
    micro_batch: int,
    steps_to_checkpoint: int,
    started: float,
    save: Callable[[dict], None],
    world: tuple[int, int] = (1, 0),
    fused: bool = False,
) -> dict:
    """The loop a user writes by hand: AdamW, linear warm-up/decay, clipping; under DDP when the
    world (size, rank) has more than one process. Batches come in ftflow's order (DistributedSampler,
    seed 42): the same global batches, so the same padding, as every other strategy.

    Returns steady-state samples/s of this process (after the first batch, checkpoint excluded),
    seconds from `started` to the end of the first step, and seconds for one checkpoint."""
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

    torch.manual_seed(42)
    pad = AutoTokenizer.from_pretrained(model_path).pad_token_id
    sampler = DistributedSampler(rows, num_replicas=world[0], rank=world[1], seed=42)
    loader = DataLoader(rows, batch_size=micro_batch, sampler=sampler, collate_fn=collate_rows(pad))
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=len(LABELS))
    if world[0] > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(param_groups(model), lr=LEARNING_RATE, weight_decay=0.01, fused=fused)
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, len(loader) // 10), len(loader))
    model.train()
    samples, checkpoint_s = 0, 0.0
    for i, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            first_step_s, steady_from = time.time() - started, time.perf_counter()
            continue
        samples += len(batch["labels"])
        if i == steps_to_checkpoint:
            checkpoint_started = time.perf_counter()
            save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            checkpoint_s = time.perf_counter() - checkpoint_started
    elapsed = time.perf_counter() - steady_from - checkpoint_s
    return {
        "samples_per_s": samples / elapsed,
        "first_step_s": first_step_s,
        "checkpoint_s": checkpoint_s,
        "peak_memory_mb": peak_rss_mb(),
    }


def baseline_process(
    model_path: str, train_uri: str, batch: int, threads: int, steps_to_checkpoint: int, fused: bool
) -> dict:
    started = time.time()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:

        def save(state: dict) -> None:
            torch.save(state, f"{folder}/checkpoint.pt")

        return hand_written_loop(
            model_path, read_tokenized(train_uri), batch, steps_to_checkpoint, started, save, fused=fused
        )


def trainer_process(
    model_path: str, train_uri: str, batch: int, threads: int, steps_to_checkpoint: int, sampling: str
) -> dict:
    """The Hugging Face Trainer as a user would pick it: one process, all the CPUs, its defaults
    (fused AdamW on this torch), ftflow's recipe (lr, warm-up, decay, clipping), dynamic padding."""
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    started = time.perf_counter()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {"step": [], "save": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.perf_counter())

        def on_save(self, args, state, control, **kwargs):
            times["save"].append(time.perf_counter())

    rows = [{"input_ids": r["input_ids"], "labels": r["label"]} for r in read_tokenized(train_uri)]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with tempfile.TemporaryDirectory() as folder:
        arguments = TrainingArguments(
            folder,
            per_device_train_batch_size=batch,
            num_train_epochs=1,
            learning_rate=LEARNING_RATE,
            warmup_steps=0.1,
            weight_decay=0.01,
            max_grad_norm=1.0,
            seed=42,
            use_cpu=True,
            train_sampling_strategy=sampling,
            save_strategy="steps",
            save_steps=steps_to_checkpoint,
            logging_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=len(LABELS)),
            arguments,
            train_dataset=Dataset.from_list(rows),
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[Clock()],
        )
        trainer.train()
    steps = times["step"]
    # The checkpoint at steps_to_checkpoint is taken after that step's end and before the next step.
    checkpoint_s = times["save"][0] - steps[steps_to_checkpoint - 1]
    return {
        "samples_per_s": (len(steps) - 1) * batch / (steps[-1] - steps[0] - checkpoint_s),
        "first_step_s": steps[0] - started,
        "checkpoint_s": checkpoint_s,
        "peak_memory_mb": peak_rss_mb(),
        "optimizer": arguments.optim.value,
    }


def in_fresh_process(function: Callable[..., dict], *args) -> dict:
    """In a fresh process: its own peak memory, and no Ray or Prefect threads beside it."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def ddp_worker(config: dict) -> None:
    import ray.train

    started = time.time()
    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    stats = hand_written_loop(
        config["model"],
        read_tokenized(config["train_uri"]),
        config["micro_batch"],
        config["steps_to_checkpoint"],
        started,
        report_from_rank0,
        (ctx.get_world_size(), ctx.get_world_rank()),
    )
    totals = torch.tensor([stats["samples_per_s"], stats["peak_memory_mb"]], dtype=torch.float64)
    torch.distributed.all_reduce(totals[:1])  # samples/s add up over workers
    torch.distributed.all_reduce(totals[1:], op=torch.distributed.ReduceOp.MAX)
    # Ray Train V2 keeps only metrics that come with a checkpoint: the last one carries the results.
    report_from_rank0({}, stats | {"samples_per_s": totals[0].item(), "peak_memory_mb": totals[1].item()})


def report_from_rank0(state: dict, metrics: dict | None = None) -> None:
    """How a Ray Train DDP user checkpoints: rank 0 saves, every rank reports."""
    import ray.train

    rank0 = ray.train.get_context().get_world_rank() == 0
    with tempfile.TemporaryDirectory() as folder:
        if rank0:
            torch.save(state, f"{folder}/checkpoint.pt")
        ray.train.report(metrics or {}, checkpoint=ray.train.Checkpoint.from_directory(folder) if rank0 else None)


def ddp(
    model_path: str, train_uri: str, batch: int, workers: int, cpus_per_worker: int, steps_to_checkpoint: int
) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {
        "model": model_path,
        "train_uri": train_uri,
        "micro_batch": batch // workers,
        "threads": cpus_per_worker,
        "steps_to_checkpoint": steps_to_checkpoint,
    }
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            ddp_worker,
            train_loop_config=config,
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpus_per_worker}),
            run_config=RunConfig(storage_path=storage),
        )
        return trainer.fit().metrics


def ftflow(
    model_path: str,
    uris: TokenizedSplits,
    max_length: int,
    batch: int,
    layout: dict,
    steps_to_checkpoint: int,
    options: dict,
    run_dir: str,
) -> dict:
    cfg = TrainConfig(
        **{"batch_size": batch, "learning_rate": LEARNING_RATE, "checkpoint_every_steps": steps_to_checkpoint}
        | layout
        | options
    )
    model = ModelConfig(name_or_path=model_path, max_length=max_length)
    row = train(TrainingJob(shards=uris, model=model, targets=LABELS, train=cfg, store=RunStore.at(run_dir))).history[
        -1
    ]
    return {
        "samples_per_s": row.samples_per_s,
        "first_step_s": row.startup_s,
        "checkpoint_s": row.checkpoint_s,
        "peak_memory_mb": row.peak_memory_mb,
    }


def sample(split: str, rows: int, folder: Path) -> str:
    """`rows` reviews spread evenly over the shipped split (it is sorted by label)."""
    lines = (ROOT / "data" / "rotten_tomatoes" / f"{split}.jsonl").read_text().split("\n")[:-1]
    path = folder / f"{split}.jsonl"
    path.write_text("\n".join(lines[:: max(1, len(lines) // rows)][:rows]) + "\n")
    return str(path)


def tokenized_rows(model_path: str, max_length: int, rows: int, folder: Path) -> dict:
    """Training rows and a small validation split, tokenized by ftflow's own stage."""
    splits = load_splits(
        DataConfig(
            train_uri=sample("train", rows, folder),
            validation_uri=sample("validation", 64, folder),
            test_uri=sample("test", 64, folder),
        )
    )
    return tokenize(tokenize_key(splits, model_path, max_length, str(folder)), splits, model_path)


BASELINES = ("pytorch (baseline)", "pytorch, fused adamw", "hf trainer, group_by_length")


def table(results: dict[str, dict]) -> str:
    bases = [name for name in BASELINES if name in results]
    lines = [
        "| strategy | samples/s | "
        + " | ".join(f"vs {name}" for name in bases)
        + " | peak memory per worker | time to first step | checkpoint | wall |",
        "|---" * (6 + len(bases)) + "|",
    ]
    for name, r in results.items():
        ratios = " | ".join(f"{r['samples_per_s'] / results[base]['samples_per_s']:.2f}" for base in bases)
        lines.append(
            f"| {name} | {r['samples_per_s']:.1f} | {ratios} | {r['peak_memory_mb']:,.0f} MiB "
            f"| {r['first_step_s']:.1f} s | {r['checkpoint_s']:.1f} s | {r['wall_s']:.0f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=ModelConfig().name_or_path)
    parser.add_argument("--rows", type=int, default=960, help="training rows (global batches x batch size)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--workers", type=int, help="Ray Train workers (default: ftflow's; Ray Train DDP: 2)")
    parser.add_argument("--cpus-per-worker", type=int, help="(default: ftflow's; Ray Train DDP: 1)")
    parser.add_argument("--only", nargs="*", help="strategies to run (default: all)")
    args = parser.parse_args()

    cluster.connect()
    cpus = int(cluster.Resources.of_cluster().cpus)
    steps = args.rows // args.batch_size
    results: dict[str, dict] = {}
    layout = {
        key: value
        for key, value in {"num_workers": args.workers, "cpus_per_worker": args.cpus_per_worker}.items()
        if value
    }
    with tempfile.TemporaryDirectory() as tmp:
        uris = tokenized_rows(args.model, args.max_length, args.rows, Path(tmp))
        half = steps // 2  # every strategy checkpoints once, half-way
        runs = {
            "pytorch (baseline)": partial(
                in_fresh_process, baseline_process, args.model, uris.train, args.batch_size, cpus, half, False
            ),
            "pytorch, fused adamw": partial(
                in_fresh_process, baseline_process, args.model, uris.train, args.batch_size, cpus, half, True
            ),
            "hf trainer": partial(
                in_fresh_process, trainer_process, args.model, uris["train"], args.batch_size, cpus, half, "random"
            ),
            "hf trainer, group_by_length": partial(
                in_fresh_process,
                trainer_process,
                args.model,
                uris["train"],
                args.batch_size,
                cpus,
                half,
                "group_by_length",
            ),
            "ray train ddp": partial(
                ddp, args.model, uris["train"], args.batch_size, args.workers or 2, args.cpus_per_worker or 1, half
            ),
        } | {
            name: partial(
                ftflow, args.model, uris, args.max_length, args.batch_size, layout, half, options, f"{tmp}/runs/{i}"
            )
            for i, (name, options) in enumerate(DEEPSPEED.items())
        }
        for name, run in runs.items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            started = time.perf_counter()
            results[name] = run() | {"wall_s": time.perf_counter() - started}
            print(f"RESULT {name}: {json.dumps(results[name])}", flush=True)
    print(
        f"\n{args.model}, {args.rows} rows, global batch {args.batch_size}, ftflow layout {layout or 'default'}"
        f" (baselines: 1 process x {cpus} threads), max length {args.max_length}\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
