"""The whole job against a one-process script: what a user timing ftflow against their own code sees.
Three jobs, each from a cold `python` process, in one run on one machine:

    (a) bench/trainer_job.py: the HF Trainer in one process (tokenize, one epoch of ftflow's defaults
        with group_by_length, validation as ftflow validates, the test split predicted to Parquet with
        its metrics, the model saved); on a GPU twice, with torch's default attention kernel and, as
        ftflow's workers run, without cuDNN's (a2);
    (b) `ftflow run` as `make run` runs it, its second run on the same storage root (the tokenized
        shards reused; a first run of one step tokenizes), with a temporary Prefect server and a local Ray;
    (c) `ftflow run` against a running local stack (`ftflow stack up`: Prefect server, Ray head).

For each: the wall time, its phases, and the ratio to (a); then the issue's targets, met or not.
ftflow's phases come from its run manifest's seconds.phases. The tables go in bench/RESULTS.md.

This machine's speed moves by up to a third from one minute to the next (the same training steps
ran 62 and 83 samples/s minutes apart), so each ratio is taken within a round, and `--rounds N` runs
the three jobs N times, each round in another order, the targets judged on the median ratio.

    python bench/end_to_end.py [--max-steps N] [--rounds N]   # N steps: a quick look; default: the epoch
    python bench/end_to_end.py --set model.name_or_path=/tmp/bert --set train.batch_size=256   # any field,
                                                                        # for every job
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FTFLOW = [sys.executable, "-m", "ftflow.cli"]  # as the `ftflow` command runs (the GPU kit has no console script)
GPU = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0 if shutil.which("nvidia-smi") else False
# Issue 41: on a CPU, (b) <= 1.15x (a), (c) <= 1.0x (a); with the stack, the flow's start to the first
# step <= 6 s and training's end to the end <= 4 s. On a GPU, (b) <= 1.3x, (c) <= 1.0x, the first
# step <= 10 s with the stack.
TARGETS = {"b": 1.3, "c": 1.0} if GPU else {"b": 1.15, "c": 1.0}
STACK_FIRST_STEP_S, STACK_END_S = (10.0, 4.0) if GPU else (6.0, 4.0)
NAMES = {
    "a": "(a) HF Trainer, one process",
    "a2": "(a2) HF Trainer, no cuDNN attention",
    "b": "(b) `ftflow run`, 2nd run",
    "c": "(c) `ftflow run`, stack up",
}
# Manifest phases, grouped as the table shows them.
PHASES = {
    "imports": ["imports and Prefect's start"],
    "cluster start": ["checks and Ray's start", "tokenize"],
    "to the first step": [
        "Ray Train's worker processes",
        "process group, model and engine",
        "first batch from the data pipeline",
        "first micro-batch",
    ],
    "training": ["training steps", "last validation, checkpoint, test labels", "export and Ray Train's end"],
}


def environment(**extra: str) -> dict[str, str]:
    """A user's shell: no test session's Prefect or Ray, the Makefile's settings."""
    own = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_ADDRESS", "RAY_AUTH"))}
    return (
        own
        | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        | extra
    )


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return seconds, done.stdout


def trainer_job(out: Path, max_steps: int, sets: list[str], attention: str = "torch") -> dict:
    given = [f"--set={assignment}" for assignment in sets]
    command = ["bench/trainer_job.py", str(out), f"--max-steps={max_steps}", f"--attention={attention}", *given]
    wall, stdout = timed([sys.executable, *command], environment())
    marks = json.loads(stdout.strip().splitlines()[-1])
    phases = {
        "imports": marks["imported"] - marks["started"],
        "cluster start": 0.0,
        "to the first step": marks["first_step"] - marks["imported"],
        "training": marks["trained"] - marks["first_step"],
    }
    return {"wall": wall, "phases": phases, "accuracy": marks["test_accuracy"]}


def ftflow_run(root: Path, max_steps: int, sets: list[str], env: dict[str, str]) -> dict:
    steps = [f"train.max_steps={max_steps}"] if max_steps else []
    given = [f"--set={assignment}" for assignment in (f"storage_root={root}", *steps, *sets)]
    wall, stdout = timed([*FTFLOW, "run", *given], env)
    run_dir = next(line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.startswith("artifacts:"))
    seconds = json.loads(Path(run_dir, "manifest.json").read_text())["seconds"]
    phases = {group: sum(seconds["phases"].get(p, 0.0) for p in names) for group, names in PHASES.items()}
    return {
        "wall": wall,
        "phases": phases,
        "accuracy": json.loads(Path(run_dir, "metrics.json").read_text())["accuracy"],
        "first step": seconds.get("start to first training step"),
        "after training": seconds["training's end to the report"] + (wall - sum(seconds["phases"].values())),
        "manifest": seconds["phases"],
    }


def with_stack(state: Path, root: Path, max_steps: int, sets: list[str]) -> dict:
    """`ftflow stack up` in its own folder, the run against it, `ftflow stack down`."""
    stack = {"FTFLOW_STACK_DIR": str(state)}
    timed([*FTFLOW, "stack", "up"], environment(**stack))
    try:
        token = str(state / "ray-auth-token")
        env = environment(
            PREFECT_API_URL="http://127.0.0.1:4200/api",
            RAY_ADDRESS="127.0.0.1:6379",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=token,
        )
        return ftflow_run(root, max_steps, sets, env)
    finally:
        timed([*FTFLOW, "stack", "down"], environment(**stack))


def row(name: str, job: dict, baselines: list[float]) -> str:
    phases = job["phases"]
    end = job["wall"] - sum(phases.values())
    cells = [f"{job['wall']:.1f}", *(f"{phases[g]:.1f}" for g in PHASES), f"{end:.1f}"]
    ratios = [f"{job['wall'] / baseline:.2f}" for baseline in baselines]
    return f"| {name} | " + " | ".join([*cells, *ratios, f"{job['accuracy']:.4f}"]) + " |"


def report(jobs: dict[str, dict]) -> None:
    baselines = [key for key in ("a", "a2") if key in jobs]
    print(
        "| job | wall s | imports | cluster start | to the first step | training | training's end to the end | "
        + " | ".join(f"x ({key})" for key in baselines)
        + " | test accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(baselines))
    for key, job in jobs.items():
        print(row(NAMES[key], job, [jobs[b]["wall"] for b in baselines]))
    for key in ("b", "c"):
        if key in jobs:
            print(f"\n({key}) manifest phases: " + ", ".join(f"{k} {v:.1f}" for k, v in jobs[key]["manifest"].items()))
    print()


def judge(rounds: list[dict[str, dict]]) -> None:
    """The targets, on the median over rounds of each round's own ratio."""
    print(f"over {len(rounds)} round(s), the median of each round's ratio:")
    for key, bound in TARGETS.items():
        for baseline in ("a", "a2"):
            if key in rounds[0] and baseline in rounds[0]:
                ratio = statistics.median(jobs[key]["wall"] / jobs[baseline]["wall"] for jobs in rounds)
                print(f"target {key}: {ratio:.2f}x ({baseline}) <= {bound}: {'met' if ratio <= bound else 'NOT met'}")
    if "c" in rounds[0]:
        for what, name, bound in (
            ("the flow's start to the first step", "first step", STACK_FIRST_STEP_S),
            ("training's end to the end", "after training", STACK_END_S),
        ):
            seconds = statistics.median(jobs["c"][name] for jobs in rounds)
            print(f"target c, {what}: {seconds:.1f} s <= {bound}: {'met' if seconds <= bound else 'NOT met'}")
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), "")
    print(f"\nmachine: {os.cpu_count()} cores, {cpu or platform.processor()}; commit {commit()}")


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def one_round(work: Path, number: int, args: argparse.Namespace) -> dict[str, dict]:
    """(a), (b) and (c) (and a2 on a GPU), starting at a different one in each round."""
    steps, sets = args.max_steps, args.sets
    run = {
        "a": lambda: trainer_job(work / f"trainer-{number}", steps, sets),
        "a2": lambda: trainer_job(work / f"trainer-{number}-no-cudnn", steps, sets, "no-cudnn"),
        "b": lambda: ftflow_run(work / "root", steps, sets, environment()),
        "c": lambda: with_stack(work / "stack", work / "root", steps, sets),
    }
    keys = ["a", *(["a2"] if GPU else []), "b", *([] if args.no_stack else ["c"])]
    order = keys[number % len(keys) :] + keys[: number % len(keys)]
    jobs = {}
    for key in order:
        jobs[key] = run[key]()
        print(f"{NAMES[key]}: {jobs[key]['wall']:.1f} s", flush=True)  # a run cut short still shows these
    return {key: jobs[key] for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=0, help="optimizer steps of every job (0: one epoch)")
    parser.add_argument("--rounds", type=int, default=1, help="the three jobs this many times, in turn")
    parser.add_argument("--no-stack", action="store_true", help="leave out (c)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="a field for every job")
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep it (runs, manifests)")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ftflow-e2e-") as folder:
        work = args.keep or Path(folder)
        ftflow_run(work / "root", 1, args.sets, environment())  # the first run: tokenizes, leaves a champion
        rounds = []
        for number in range(args.rounds):
            rounds.append(one_round(work, number, args))
            print(f"round {number + 1}:")
            report(rounds[-1])
        judge(rounds)


if __name__ == "__main__":
    main()
