"""What DeepSpeed's engine costs the host per training step, beside the plain loop (issue 58). On the H200
ftflow's step took ~60-65 ms more than a plain bf16 loop's with the same attention kernel, at batch 32
(96 against 34 ms) and at 256 (114 against 47): a fixed cost per step, not compute. Here a model of
BERT-base's shape (its 12 layers and every one of its parameter tensors) with tiny widths, so that the
compute is small and the host's work per step shows, trains the same batches in one process on one
thread (a GPU worker gets one CPU):

    (a) a plain loop: torch's AdamW, bf16 autocast, gradient clipping, as bench/gpu/baselines.py;
    (b) DeepSpeed's engine with ftflow's JSON (tasks/train/deepspeed_json.py), bf16, at each ZeRO stage given.

Printed: ms per step (the median of 5 blocks of steps, after a warm-up) and the ratio to (a).

    python bench/step_overhead.py [--steps 100] [--batch 4] [--length 8] [--stages 0,2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

from tasks.core.train_config import TrainConfig
from tasks.train.deepspeed_json import deepspeed_config
from tasks.train.engine import param_groups
from tasks.train.spec import Plan

WARMUP, BLOCKS = 10, 5


def bert_shaped() -> torch.nn.Module:
    config = BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, intermediate_size=128
    )
    return BertForSequenceClassification(config)


def batches(count: int, batch: int, length: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 1000, (batch, length), generator=generator),
            "labels": torch.randint(0, 2, (batch,), generator=generator),
        }
        for _ in range(count)
    ]


def ms_per_step(step, data: list[dict]) -> float:
    """The median over BLOCKS blocks of ms per step, after WARMUP steps."""
    for batch in data[:WARMUP]:
        step(batch)
    per_block, times = (len(data) - WARMUP) // BLOCKS, []
    for block in range(BLOCKS):
        started = time.perf_counter()
        for batch in data[WARMUP + block * per_block : WARMUP + (block + 1) * per_block]:
            step(batch)
        times.append((time.perf_counter() - started) / per_block * 1000)
    return statistics.median(times)


def plain(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(param_groups(model), lr=5e-5, weight_decay=0.01)

    def step(batch: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine(model: torch.nn.Module, stage: int, batch: int, steps: int):
    import deepspeed

    cfg = TrainConfig(zero_stage=stage, precision="bf16", batch_size=batch)
    plan = Plan(workers=1, cpus_per_worker=1, micro_batch=batch, accumulation=1, use_gpu=False, precision="bf16")
    config = deepspeed_config(cfg, plan, steps, hidden_size=64)
    built, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)

    def step(batch: dict) -> None:
        built.backward(built(**batch).loss)
        built.step()

    return step


def main(steps: int, batch: int, length: int, stages: list[int]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    model, data = bert_shaped(), batches(steps, batch, length)
    base = ms_per_step(plain(copy.deepcopy(model)), data)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters in {len(list(model.parameters()))} tensors")
    print(
        f"| loop, batch {batch} x {length} tokens | ms per step | x (a) |\n|---|---|---|\n"
        f"| (a) plain, AdamW, bf16 autocast | {base:.1f} | 1.00 |"
    )
    for stage in stages:
        ms = ms_per_step(engine(copy.deepcopy(model), stage, batch, steps), data)
        print(f"| (b) DeepSpeed's engine, ftflow's JSON, bf16, ZeRO-{stage} | {ms:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=8, help="tokens per row: few, so that compute is small")
    parser.add_argument("--stages", default="0,2")
    args = parser.parse_args()
    main(args.steps, args.batch, args.length, [int(stage) for stage in args.stages.split(",")])
