"""What a lost node costs a run (issue 57): `ftflow run` of the tiny model on the shipped reviews, 2
training workers of 1 CPU on a cluster of separate `ray start` nodes on this machine (a head that takes
no work and four 1-CPU nodes: the two workers, Ray Data's split of the training stream, a spare), and
the node of a training worker killed mid-epoch once a checkpoint is committed (SIGKILL to its raylet and
its workers: a node gone without notice, as one that falls off the network). Seconds from the kill to the
run saying so, to rank 0's resume from the checkpoint, and to the first training step after it, with the
steps trained again; the run must then complete. Times are when each line reached the console: the
workers' lines come through the driver's relay, every DRAIN_EVERY_S (tasks/core/progress.py).

With --elastic, `train.num_workers: [1, 2]` on three nodes (no spare: the run goes on with 1 worker), at
--zero-stage: the resize line's time too, and the final validation loss against two uninterrupted runs
on the same cluster (seeds 42 and 43: their gap is the noise it is judged by).

    python bench/lost_node.py [--checkpoint-every 20] [--elastic --zero-stage 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_model import make_tiny_bert  # noqa: E402

from ftflow.temporary_api import free_port  # noqa: E402
from infra.local.stack import HEAD_ENV, RAY, ray_head_command  # noqa: E402
from tasks.core.config import DataConfig, FinetuneParams, ModelConfig  # noqa: E402
from tasks.core.train_config import TrainConfig  # noqa: E402

DATA = ROOT / "data" / "rotten_tomatoes"
FTFLOW = str(Path(sys.executable).parent / "ftflow")
NODES = 4  # two training workers, Ray Data's split of the training stream, a spare (none with --elastic)
# the cluster's processes and its driver: token authentication, as ftflow's stack runs Ray
SECURED = {**os.environ, **HEAD_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def start_node(port: int, log: Path) -> subprocess.Popen:
    """A 1-CPU `ray start --block` node joining the head, once it says it is up (one at a time: four
    started at once here, three timed out)."""
    node = subprocess.Popen(
        [*RAY, "start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        + ["--dashboard-agent-listen-port", str(free_port()), "--block", "--disable-usage-stats"],
        env=SECURED,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    while "Ray runtime started" not in log.read_text():
        if node.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.2)
    return node


def trains(node: subprocess.Popen) -> bool:
    """Whether a training worker runs on the node (its processes descend from its `ray start`)."""
    return any("RayTrainWorker" in " ".join(p.cmdline()) for p in psutil.Process(node.pid).children(recursive=True))


def run_params(folder: Path, checkpoint_every: int, train: dict) -> Path:
    """One epoch of the shipped reviews (267 steps of 32 rows), a checkpoint every `checkpoint_every`
    steps, a tick every 2 steps, and `train`'s fields; every node on this machine's disk."""
    params = FinetuneParams(
        data=DataConfig(**{f"{split}_uri": str(DATA / f"{split}.jsonl") for split in ("train", "validation", "test")}),
        model=ModelConfig(name_or_path=str(make_tiny_bert(folder / "model")), max_length=64),
        train=TrainConfig(
            epochs=1,
            batch_size=32,
            num_workers=2,
            cpus_per_worker=1,
            checkpoint_every_steps=checkpoint_every,
            log_every_steps=2,
            max_failures=1,
        ).model_copy(update=train),
        storage_root=str(folder / "store"),
        storage_shared=True,
    )
    (path := folder / f"params-{len(list(folder.glob('params*')))}.json").write_text(params.model_dump_json())
    return path


class Console:
    """The run's console lines as they come, each with when it came (time.monotonic())."""

    def __init__(self, run: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self.read, args=(run.stdout,), daemon=True)
        self.reader.start()

    def read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        return next(
            ((at, found) for at, line in list(self.lines) if at >= after and (found := re.search(pattern, line))), None
        )

    def latest_step(self) -> int:
        steps = [
            int(found[1]) for _, line in list(self.lines) if (found := re.search(r"train: (\d+) / \d+ steps", line))
        ]
        return max(steps, default=0)


def killed_mid_epoch(nodes: list[subprocess.Popen], console: Console, checkpoint_every: int) -> float:
    """SIGKILL the first node with a training worker once the console has shown the step half-way
    between the second and the third checkpoint (the workers are further on: the relay's delay), and
    return when."""
    while console.latest_step() < 2 * checkpoint_every + checkpoint_every // 2:
        time.sleep(0.05)
    [victim, *_] = [node for node in nodes if trains(node)]
    killed_at = time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)
    return killed_at


def ftflow_run(params: Path, port: int) -> tuple[subprocess.Popen, Console]:
    run = subprocess.Popen(
        [FTFLOW, "run", "--verbose", "--params", str(params)],
        cwd=ROOT,
        env={**SECURED, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return run, Console(run)


def finished(run: subprocess.Popen, console: Console) -> None:
    run.wait(timeout=900)
    console.reader.join(timeout=10)


def final_val_loss(console: Console) -> float:
    """The last epoch's validation loss, from the finished run's manifest."""
    found = console.first(r"artifacts: +(\S+)")
    if found is None:
        sys.exit("a run did not finish:\n" + "\n".join(line for _, line in console.lines[-40:]))
    manifest = json.loads((Path(found[1][1]) / "manifest.json").read_text())
    return manifest["metrics"]["training"]["history"][-1]["val_loss"]


def uninterrupted(folder: Path, port: int, checkpoint_every: int, train: dict) -> list[float]:
    """The final validation loss of runs never interrupted, with seeds 42 and 43, on the same cluster."""
    losses = []
    for seed in (42, 43):
        run, console = ftflow_run(run_params(folder, checkpoint_every, train | {"seed": seed}), port)
        finished(run, console)
        losses.append(final_val_loss(console))
    return losses


def measure(checkpoint_every: int, elastic: bool, zero_stage: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="lost-node-"))
    train = {"zero_stage": zero_stage} | ({"num_workers": (1, 2)} if elastic else {})
    port, dashboard = free_port(), free_port()
    head = subprocess.Popen(
        ray_head_command(port, "--num-cpus", "0", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard))
        + ["--dashboard-agent-listen-port", str(free_port())],
        env=SECURED,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    nodes, baseline = [], []
    try:
        nodes = [start_node(port, folder / f"node-{n}.log") for n in range(NODES - elastic)]
        baseline = uninterrupted(folder, port, checkpoint_every, train) if elastic else []
        run, console = ftflow_run(run_params(folder, checkpoint_every, train), port)
        killed_at = killed_mid_epoch(nodes, console, checkpoint_every)
        finished(run, console)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
    report(console, run.returncode, killed_at, checkpoint_every)
    if baseline:
        print(
            f"final validation loss {final_val_loss(console):.4f}; uninterrupted, seed 42: {baseline[0]:.4f}, "
            f"seed 43: {baseline[1]:.4f} (the noise: {abs(baseline[0] - baseline[1]):.4f})"
        )


def report(console: Console, returncode: int, killed_at: float, checkpoint_every: int) -> None:
    said = console.first(r"training worker \d failed.*|lost training worker.*", killed_at)
    named = console.first(r"lost training worker \d's node \w+ without notice.*", killed_at)
    resumed = console.first(r"rank 0: resumed from the checkpoint at step (\d+)", killed_at)
    if returncode != 0 or said is None or resumed is None:
        sys.exit("the run did not go on after the lost node:\n" + "\n".join(line for _, line in console.lines[-60:]))
    from_step = int(resumed[1][1])
    stepped = console.first(rf"train: (?!{from_step}\b)\d+ / \d+ steps", resumed[0])
    at_step = re.search(r"at step (\d+)", said[1][0])  # the worker's last heartbeat before the kill
    print(f"checkpoint every {checkpoint_every} steps; said: {said[1][0]}")
    print("| from the kill to | seconds |")
    print("|---|---|")
    print(f"| the run saying the worker is lost | {said[0] - killed_at:.1f} |")
    if named:
        print(f"| the run naming the lost node ({named[1][0]}) | {named[0] - killed_at:.1f} |")
    for what, pattern in (
        ("the run saying it goes on with fewer workers", r"the run goes on with \d+ instead of \d+ training workers"),
        ("Ray Train's new worker group started", r"Started training worker group"),
        ("rank 0's engine built", r"rank 0: engine built"),
    ):
        if seen := console.first(pattern, killed_at):
            print(f"| {what} | {seen[0] - killed_at:.1f} |")
    print(f"| rank 0 resumed from step {from_step}'s checkpoint | {resumed[0] - killed_at:.1f} |")
    if stepped:
        print(f"| the first step after it ({stepped[1][0]}) | {stepped[0] - killed_at:.1f} |")
    again = int(at_step[1]) - from_step if at_step else "unknown"
    print(f"steps trained again: {again}; the run completed (exit 0)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--elastic", action="store_true", help="num_workers [1, 2] on three nodes, no spare")
    parser.add_argument("--zero-stage", type=int, default=0, choices=range(4))
    args = parser.parse_args()
    measure(args.checkpoint_every, args.elastic, args.zero_stage)
