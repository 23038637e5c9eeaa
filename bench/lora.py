"""LoRA against full fine-tuning (issue 56): the main job (`ftflow run`: the shipped reviews, the shipped
MiniLM, 1 epoch) twice in one run, every weight trained and then LoRA adapters (train.lora at its
defaults: r 8, alpha 16, every attention and MLP projection), each at its learning rate. Target: LoRA's
test accuracy within 0.02 of full fine-tuning's. Printed: test accuracy, parameters trained, peak
memory per worker, training samples/s and the whole job's seconds.

    python bench/lora.py [--lora-learning-rate 1e-3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from task_kinds import ftflow


def row(name: str, manifest: dict, wall: float) -> dict:
    training, last = manifest["metrics"]["training"], manifest["metrics"]["training"]["history"][-1]
    return {
        "run": name,
        "test accuracy": manifest["metrics"]["test"]["accuracy"],
        "trained": training["trained_parameters"],
        "parameters": training["parameters"],
        "peak MiB": last["peak_memory_mb"],
        "samples/s": last["samples_per_s"],
        "seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-learning-rate", type=float, default=1e-3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        full = row("full fine-tuning (2e-4)", *ftflow({}, Path(folder), "full"))
        lora = {"lora": {}, "learning_rate": args.lora_learning_rate}
        adapters = row(f"LoRA r 8 ({args.lora_learning_rate:g})", *ftflow({"train": lora}, Path(folder), "lora"))
    print("| run | test accuracy | parameters trained | peak MiB per worker | samples/s | job s |")
    print("|---|---|---|---|---|---|")
    for run in (full, adapters):
        print(
            f"| {run['run']} | {run['test accuracy']:.4f} | {run['trained']:,} of {run['parameters']:,} "
            f"({run['trained'] / run['parameters']:.1%}) | {run['peak MiB']:.0f} | {run['samples/s']:.1f} | "
            f"{run['seconds']:.0f} |"
        )
    gap = full["test accuracy"] - adapters["test accuracy"]
    verdict = "met" if gap <= 0.02 else "NOT met"
    print(f"full fine-tuning's test accuracy minus LoRA's: {gap:+.4f} (target: at most 0.02): {verdict}")


if __name__ == "__main__":
    main()
