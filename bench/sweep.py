"""A sweep with ASHA against the same sweep without a scheduler (issue 43), on this machine, in one run:

    1. `ftflow run` at the defaults: the validation accuracy a sweep must reach (it also tokenizes);
    2. `ftflow sweep` of TRIALS trials over the learning rate and the epochs, ASHA (the default);
    3. the same sweep (same seed: the same drawn configurations) with sweep.scheduler=none.

All on the shipped reviews and MiniLM, training on a seeded subset of ROWS training rows (the whole
validation and test splits), so a trial takes about a minute here. Prints each sweep's stage seconds
(the manifest's), the ratio, each one's best validation accuracy against the default run's, and the
best model's test accuracy. Targets: ASHA's sweep at most half the other's time; its best validation
accuracy at or above the default configuration's.

    python bench/sweep.py [--rows 1024] [--trials 8] [--epochs 1 2] [--asha-only]

`--rows 0` trains on every training row (the full-data target: the best model's test accuracy at or
above `make run`'s 0.8246); `--asha-only` runs no scheduler-less sweep.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from end_to_end import FTFLOW, environment

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "rotten_tomatoes"
# Evaluations at every 16 steps and at epoch ends: ASHA's rungs; the first after 512 rows.
TRAIN = {"train.eval_every_steps": 16}
SPACE = {"train.learning_rate": {"loguniform": [1e-5, 1e-3]}, "train.epochs": {"choice": [1, 2]}}


def space(epochs: list[int]) -> dict:
    return SPACE | {"train.epochs": {"choice": epochs}}


def subset(rows: int, folder: Path) -> Path:
    if not rows:
        return DATA / "train.jsonl"
    lines = (DATA / "train.jsonl").read_text().strip().split("\n")  # not splitlines: texts hold U+2028
    random.Random(0).shuffle(lines)
    path = folder / f"train-{rows}.jsonl"
    path.write_text("\n".join(lines[:rows]) + "\n")
    return path


def ftflow(command: str, params: dict, root: Path, run_id: str) -> tuple[dict, float]:
    """The command on params; its manifest and wall seconds."""
    file = root.parent / f"{run_id}.json"
    file.write_text(json.dumps(params | {"storage_root": str(root), "run_id": run_id}))
    started = time.perf_counter()
    done = subprocess.run([*FTFLOW, command, "--params", str(file)], env=environment(), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((root / "runs" / run_id / "manifest.json").read_text()), wall


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        where = out
        for parent in parents:
            where = where.setdefault(parent, {})
        where[leaf] = value
    return out


def best_validation(manifest: dict) -> float:
    return max(point["accuracy"] for point in manifest["metrics"]["training"]["curve"]["validation"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 2], help="The epochs to choose from.")
    parser.add_argument("--asha-only", action="store_true", help="No scheduler-less sweep to compare with.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "store"
        data = {
            "data": {
                "train_uri": str(subset(args.rows, Path(folder))),
                "validation_uri": str(DATA / "validation.jsonl"),
                "test_uri": str(DATA / "test.jsonl"),
            }
        }
        base = data | (nested(TRAIN) if args.rows else {})  # the full data: make run's evaluations, every 100 steps
        default, default_wall = ftflow("run", base, root, "default")
        sweeps = {}
        for scheduler in ("asha",) if args.asha_only else ("asha", "none"):
            search = {"sweep": {"space": space(args.epochs), "trials": args.trials, "scheduler": scheduler, "seed": 0}}
            sweeps[scheduler] = ftflow("sweep", base | search, root, f"sweep-{scheduler}")
    default_accuracy = best_validation(default)
    print(
        f"default run: {default_wall:.0f} s, validation accuracy {default_accuracy:.4f}, "
        f"test accuracy {default['metrics']['test']['accuracy']:.4f}"
    )
    print("| sweep | trials stopped early | sweep stage s | whole s | best val accuracy | test accuracy |")
    print("|---|---|---|---|---|---|")
    for scheduler, (manifest, wall) in sweeps.items():
        searched = manifest["metrics"]["sweep"]
        stopped = sum(trial["status"] == "stopped early" for trial in searched["trials"])
        best = max(trial["best"] for trial in searched["trials"] if trial["best"] is not None)
        print(
            f"| {scheduler} | {stopped} of {len(searched['trials'])} | {manifest['seconds']['sweep']:.0f} | {wall:.0f} "
            f"| {best:.4f} | {manifest['metrics']['test']['accuracy']:.4f} |"
        )
    if "none" in sweeps:
        ratio = sweeps["asha"][0]["seconds"]["sweep"] / sweeps["none"][0]["seconds"]["sweep"]
        print(f"ASHA / no scheduler, sweep stage: {ratio:.2f}x (target <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'})")
    test = sweeps["asha"][0]["metrics"]["test"]["accuracy"]
    print(f"ASHA's best model's test accuracy {test:.4f} (target on the full data >= 0.8246)")
    asha_best = max(t["best"] for t in sweeps["asha"][0]["metrics"]["sweep"]["trials"] if t["best"] is not None)
    print(
        f"ASHA's best validation accuracy {asha_best:.4f} vs the default configuration's {default_accuracy:.4f}: "
        f"{'met' if asha_best >= default_accuracy else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
