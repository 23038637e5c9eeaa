"""Soak: the finetune flow many times in a row in one process (tiny model, small data), and after each
run what a long-lived Prefect worker or notebook would accumulate: this process's descendants and
threads, its open files, Ray sessions on disk, the bytes of the temporary folder (less the runs' own
store and the live Ray session's logs, counted apart: Ray appends to its daemons' logs and keeps a
file per worker that ever ran, and deletes none, ray-project/ray#62961) and of Prefect's home (its
database keeps every run's record, by design).

    python bench/soak.py [--runs 20]

Prints a Markdown table for bench/RESULTS.md and the growth from run 1 to the last run; exits 1 if
processes, threads, open files or Ray sessions reached a new high in the second half of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RAY_TMP = Path(tempfile.gettempdir(), "ray")
LEAKS = ("processes", "threads", "open files", "Ray sessions")  # none may grow

from conftest import read_jsonl, write_jsonl  # noqa: E402
from tiny_model import make_tiny_bert  # noqa: E402

from flows.finetune import finetune  # noqa: E402
from tasks.core.config import SHIPPED_DATA, DataConfig, FinetuneParams, ModelConfig  # noqa: E402
from tasks.core.train_config import TrainConfig  # noqa: E402


def mib(size: int) -> float:
    return round(size / 2**20, 1)


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
        except OSError:  # a file removed while counted
            pass
    return total


def sample(work: Path) -> dict:
    me = psutil.Process()
    descendants = [p for p in me.children(recursive=True) if "tasks.core.reaper" not in " ".join(p.cmdline())]
    stored = folder_bytes(work)  # the runs themselves: grows by design
    ray_logs = folder_bytes(RAY_TMP / "session_latest" / "logs")
    return {
        "processes": len(descendants),
        "threads": me.num_threads(),
        "open files": me.num_fds(),
        "Ray sessions": len(list(RAY_TMP.glob("session_2*"))),
        "tmp MiB (less the runs, Ray's logs)": mib(folder_bytes(Path(tempfile.gettempdir())) - stored - ray_logs),
        "Ray's logs MiB": mib(ray_logs),
        "Prefect home MiB": mib(folder_bytes(Path.home() / ".prefect")),
        "runs MiB": mib(stored),
    }


def slices(folder: Path, rows: dict[str, int]) -> dict[str, str]:
    """Balanced slices of the shipped reviews, as the tests take them."""
    out = {}
    for split, n in rows.items():
        reviews = read_jsonl(SHIPPED_DATA / f"{split}.jsonl")
        balanced = [r for r in reviews if r["label"] == 0][: n // 2] + [r for r in reviews if r["label"] == 1][: n // 2]
        out[split] = str(write_jsonl(folder / f"{split}.jsonl", balanced))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2: growth is measured after the first run")
    work = Path(tempfile.mkdtemp(prefix="ftflow-soak-"))
    model = make_tiny_bert(work / "tiny-bert")
    data = slices(work / "data", {"train": 512, "validation": 64, "test": 64})
    params = FinetuneParams(
        data=DataConfig(train_uri=data["train"], validation_uri=data["validation"], test_uri=data["test"]),
        model=ModelConfig(name_or_path=str(model), max_length=64),
        train=TrainConfig(epochs=1, batch_size=32, learning_rate=1e-3),
        storage_root=str(work / "store"),
    )
    rows = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        finetune(params)
        time.sleep(2)  # what ends with a run has ended
        rows.append({"run": run, "seconds": round(time.monotonic() - started, 1), **sample(work)})
        print(json.dumps(rows[-1]), flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    growth = {k: round(rows[-1][k] - rows[0][k], 1) for k in keys[2:]}
    print(f"\ngrowth from run 1 to run {args.runs}: {growth}; live threads: {threading.active_count()}")
    # Ray keeps a pool of idle workers that it starts and stops as it likes (17-19 processes over 20
    # runs): a count that only churns is not a leak, a later high above every earlier one is.
    half = len(rows) // 2
    grew = [k for k in LEAKS if max(row[k] for row in rows[half:]) > max(row[k] for row in rows[:half])]
    print(f"grew in the second half of the runs: {grew or 'nothing'}")
    sys.exit(1 if grew else 0)


if __name__ == "__main__":
    main()
