"""Where a GPU job's start-up goes, outside ftflow: each import in a fresh process (twice: the first
compiles the site's bytecode), CUDA's start, Ray's, a 1-GPU actor's, and an empty Ray Train job's.
    python3 bench/gpu/startup.py"""

import subprocess
import sys
import time

IMPORTS = {
    "python": "pass",
    "torch": "import torch",
    "torch + CUDA context": "import torch; torch.zeros(1, device='cuda')",
    "transformers BERT": "from transformers import BertForSequenceClassification",
    "deepspeed": "import deepspeed",
    "ray": "import ray",
    "ray.train.torch": "import ray.train.torch",
    "ray.data": "import ray.data",
    "prefect": "import prefect",
    "flows.finetune": "import flows.finetune",
    "tasks.train.worker": "import tasks.train.worker",
}


def process_seconds(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - started


for name, code in IMPORTS.items():
    first, second = process_seconds(code), process_seconds(code)
    print(f"RESULT startup, {name}: {first:.1f} s first, {second:.1f} s again", flush=True)

import ray  # noqa: E402
from ray.train import ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

started = time.perf_counter()
ray.init(include_dashboard=False)
print(f"RESULT startup, ray.init (local): {time.perf_counter() - started:.1f} s", flush=True)


@ray.remote(num_gpus=1)
def cuda_task() -> None:
    import torch

    torch.zeros(1, device="cuda")


for attempt in ("first", "again"):
    started = time.perf_counter()
    ray.get(cuda_task.remote())
    print(f"RESULT startup, a 1-GPU task with CUDA ({attempt}): {time.perf_counter() - started:.1f} s", flush=True)


def empty_loop() -> None:
    import torch

    torch.zeros(1, device="cuda")


for attempt in ("first", "again"):
    started = time.perf_counter()
    TorchTrainer(empty_loop, scaling_config=ScalingConfig(num_workers=1, use_gpu=True)).fit()
    print(
        f"RESULT startup, an empty 1-GPU Ray Train job ({attempt}): {time.perf_counter() - started:.1f} s", flush=True
    )
