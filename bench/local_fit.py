"""What a Ray Train fit costs beyond its work on the local Ray that ftflow starts: 2-worker fits whose
workers do nothing, with ftflow's Trainer (tasks/train/driver.py: no placement-group cleaner where no
dashboard runs) and with Ray's TorchTrainer (the baseline), alternately in one process.
    python bench/local_fit.py [FITS_EACH]"""

import sys
import tempfile
import time

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from tasks.core import cluster
from tasks.train.trainer import Trainer


def seconds(trainer_class: type, name: str) -> float:
    started = time.perf_counter()
    run = RunConfig(storage_path=tempfile.mkdtemp(), name=name)
    trainer_class(lambda: None, scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    return time.perf_counter() - started


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cluster.connect()
    times: dict[str, list[float]] = {"TorchTrainer (baseline)": [], "ftflow's Trainer": []}
    for fit in range(count):
        times["TorchTrainer (baseline)"].append(seconds(TorchTrainer, f"baseline-{fit}"))
        times["ftflow's Trainer"].append(seconds(Trainer, f"ftflow-{fit}"))
    print("| trainer | " + " | ".join(f"fit {i + 1}" for i in range(count)) + " | mean |")
    print("|---|" + "---|" * (count + 1))
    for name, each in times.items():
        print(f"| {name} | " + " | ".join(f"{s:.1f} s" for s in each) + f" | {sum(each) / count:.1f} s |")
    baseline, ftflow = (sum(each) for each in times.values())
    print(f"ftflow / baseline, mean fit: {ftflow / baseline:.2f}")
