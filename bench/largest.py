"""The largest model each strategy trains on this machine (issue 56): Llama-style classifiers of a ladder of
sizes (4 query heads per key-value head, a 32,000-token vocabulary), their weights drawn on the workers from
the config (model.init: random; nothing written or read but a config and a tokenizer), each trained 2 steps
on documents of the reviews that fill max_length, validated on 2, checkpointed and exported: the whole job.

Per strategy, full fine-tuning and LoRA, the largest size whose estimate (strategy=auto's need per worker,
times the workers) fits the memory the workers share (host memory on CPUs, each GPU's own on GPUs) is
trained; a failed run steps down a size. Printed: the size trained, its parameters, samples/s and tokens/s,
model TFLOP/s per worker (6 x parameters x tokens/s full, 4 x under LoRA, whose frozen weights get no
gradient), the measured peak per worker and the estimate beside it, and the size above with its estimate.

    python bench/largest.py [--only zero0-1w,lora-zero3] [--sizes 0.2B,1.0B] [--reserve-gb 3] [--precision fp32]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import ray
from estimates import documents, llama, measured, need_gib

from tasks.core import cluster
from tasks.core.train_config import Lora, TrainConfig
from tasks.train import strategy

# hidden size, layers and attention heads (4 per key-value head: an even number of key-value heads, which
# tensor parallelism of 2 divides; the key-value width, and so the parameters, is a quarter of the hidden
# size however many); a SwiGLU feed-forward of 8/3 the hidden size
LADDER = {
    "0.2B": (1024, 16, 8),
    "0.45B": (1536, 16, 16),
    "0.77B": (2048, 16, 16),
    "1.0B": (2048, 22, 16),
    "1.5B": (2560, 20, 32),
    "2.0B": (2560, 28, 32),
    "2.9B": (3072, 28, 24),
    "3.9B": (3584, 28, 32),
    "5.1B": (4096, 28, 32),
    "8.2B": (4096, 46, 32),
    "14B": (5120, 50, 40),
    "30B": (6656, 64, 64),
}
RUN = {
    "max_steps": 2,
    "batch_size": 4,
    "eval_every_steps": 0,
    "keep_best": False,
    "log_every_steps": 1,
    "max_failures": 0,
}
STRATEGIES = {
    "zero0-1w": {"zero_stage": 0, "num_workers": 1},
    "zero0": {"zero_stage": 0, "num_workers": 2},
    "zero1": {"zero_stage": 1, "num_workers": 2},
    "zero2": {"zero_stage": 2, "num_workers": 2},
    "zero3": {"zero_stage": 3, "num_workers": 2},
    "zero3-1w-offload": {"zero_stage": 3, "num_workers": 1, "offload_optimizer": True, "offload_params": True},
    "tp2": {"tensor_parallel_size": 2, "num_workers": 2},
    "pp2": {"pipeline_parallel_size": 2, "num_workers": 2},
    "lora-zero0-1w": {"zero_stage": 0, "num_workers": 1, "lora": Lora()},
    "lora-zero3": {"zero_stage": 3, "num_workers": 2, "lora": Lora()},
    "lora-zero3-1w": {"zero_stage": 3, "num_workers": 1, "lora": Lora()},  # one GPU: drawn on it, partitioned
    "lora-zero0-1w-ckpt": {"zero_stage": 0, "num_workers": 1, "lora": Lora(), "activation_checkpointing": True},
}
MAX_LENGTH = 128


def shape(size: str) -> dict:
    hidden, layers, heads = LADDER[size]
    intermediate = round(8 * hidden / 3 / 256) * 256
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
    }


def budget(use_gpu: bool, reserve_gb: float) -> float:
    """GiB the workers share: one GPU's memory each (a worker per GPU), else the host's less a reserve for
    the driver, Ray and Prefect (Ray kills workers at 95% of the host's memory)."""
    if use_gpu:
        return strategy.gpu_memory() / strategy.GIB
    return psutil.virtual_memory().total * 0.95 / strategy.GIB - reserve_gb


def settled(timeout_s: float = 120) -> None:
    """Wait until the last run's workers have given their memory back (a run started while they exited
    was killed for memory: ZeRO-1 at 0.45B, which fits alone)."""
    deadline = time.monotonic() + timeout_s
    while psutil.virtual_memory().available < 0.85 * psutil.virtual_memory().total and time.monotonic() < deadline:
        time.sleep(2)


def largest(name: str, models: dict[str, Path], folder: str, data: Path, args) -> None:
    """The strategy's largest fitting size, trained (stepping down a size on a failure), as a table row."""
    cfg = TrainConfig(**(RUN | STRATEGIES[name] | {"precision": args.precision}))
    use_gpu = cluster.Resources.of_cluster().use_gpu(cfg.device)
    room = budget(use_gpu, args.reserve_gb) * (1 if use_gpu else 1 / cfg.num_workers)
    sizes = list(models)
    fitting = [size for size in sizes if need_gib(models[size], cfg, MAX_LENGTH)[0] <= room]
    at = sizes.index(fitting[-1]) if fitting else 0
    while at >= 0:
        settled()
        size, started = sizes[at], time.perf_counter()
        try:
            run = measured(models[size], folder, f"{name}-{size}", cfg, MAX_LENGTH, data, init="random")
        except Exception as error:  # noqa: BLE001 (out of memory ends a worker in many ways): one size down
            print(f"<!-- {name} at {size} failed: {str(error).splitlines()[0][:200]} -->", flush=True)
            # a fresh local Ray: after a worker's OOM kill, the next run's workers were never placed (seen)
            ray.shutdown()
            cluster.connect()
            at -= 1
            continue
        finally:
            shutil.rmtree(Path(folder) / "runs", ignore_errors=True)  # a 5B model's export is 20 GB
        above = sizes[at + 1] if at + 1 < len(sizes) else None
        row(name, size, models, run, cfg, above, time.perf_counter() - started)
        return
    print(f"| {name} | none fits | | | | | | | |", flush=True)


def row(name, size, models, run, cfg, above, seconds) -> None:
    params = strategy.ModelSize.of(str(models[size]), 2).params
    tokens_per_s = run["samples/s"] * MAX_LENGTH
    tflops = (4 if cfg.lora else 6) * params * tokens_per_s / cfg.num_workers / 1e12
    over = f"{above}: {need_gib(models[above], cfg, MAX_LENGTH)[0]:.1f}" if above else "-"
    print(
        f"| {name} | {size} | {params / 1e9:.2f} B | {run['samples/s']:.2f} | {tokens_per_s:.0f} | {tflops:.3f} | "
        f"{run['peak']:.2f} | {run['need']:.2f} | {over} | {seconds:.0f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STRATEGIES))
    parser.add_argument("--sizes", default=",".join(LADDER))
    parser.add_argument("--reserve-gb", type=float, default=3.0)
    parser.add_argument("--precision", default="auto", help="auto: fp32 on CPUs, bf16 on GPUs")
    args = parser.parse_args()
    cluster.connect()
    print(
        "| strategy | largest trained | parameters | samples/s | tokens/s | model TFLOP/s per worker | "
        "peak GiB per worker | estimate GiB | next size: estimate GiB | seconds (whole job) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        data = documents(Path(folder), rows=8, validation_rows=2)
        models = {size: llama(Path(folder), size, shape(size), weights=False) for size in args.sizes.split(",")}
        for name in args.only.split(","):
            largest(name, models, folder, data, args)


if __name__ == "__main__":
    main()
