"""A training node that receives SIGTERM (the notice Kubernetes gives a pod it evicts, and a cloud's spot
reclaim comes to) mid-training, on a cluster of separate `ray start` nodes: the workers checkpoint at
once, inside the node's drain window, and train on; once the node is gone the run goes on from that
checkpoint on the spare node, and completes with every epoch and curve point once."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import psutil
from conftest import FTFLOW, faults_injected, free_port, session_prefect
from test_cluster import ROOT, alive_nodes, start_ray_head
from test_flow import params

from infra.local.stack import RAY
from tasks.core import storage

DRAIN_S = 12  # the nodes' drain window (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; Ray's default is 30 s)


def start_node(port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A 1-CPU `ray start --block` node joining the head, once it is up: SIGTERM drains it for DRAIN_S,
    then stops it. (Four started at once here, three timed out: one at a time.)"""
    node = subprocess.Popen(
        [*RAY, "start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        + ["--dashboard-agent-listen-port", str(free_port()), "--block", "--disable-usage-stats"],
        env={**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_S)},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    while "Ray runtime started" not in log.read_text():
        assert node.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    return node


def node_of_rank_1(nodes: list[subprocess.Popen], rank_0_raylet: int) -> subprocess.Popen:
    """The node whose raylet started a training worker, other than rank 0's."""

    def trains(node: subprocess.Popen) -> bool:
        processes = psutil.Process(node.pid).children(recursive=True)
        raylets = [p for p in processes if p.name() == "raylet" and p.pid != rank_0_raylet]
        return any("RayTrainWorker" in " ".join(p.cmdline()) for raylet in raylets for p in raylet.children())

    [node] = [node for node in nodes if trains(node)]
    return node


def stop_raylet_once_answered(node: subprocess.Popen, said: Path, run: subprocess.Popen) -> None:
    """The node goes once the notice is answered, before its deadline, as a reclaimed VM may: its raylet
    SIGTERMed. Ray then calls the node's death an expected termination, not a preemption (at the deadline
    itself it is a coin toss between the two: src/ray/raylet/main.cc); ftflow's reading is what is held."""
    while "a preemption notice for node" not in said.read_text() and run.poll() is None:
        time.sleep(0.05)
    [raylet] = [p for p in psutil.Process(node.pid).children(recursive=True) if p.name() == "raylet"]
    raylet.send_signal(signal.SIGTERM)


def test_a_node_sigtermed_mid_training_is_checkpointed_at_once_and_the_run_goes_on_without_it(
    tiny_model, small_data, tmp_path
):
    port, token = free_port(), secrets.token_hex(32)
    secured = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    # No work on the head (it is not SIGTERMed); a dashboard, as a cluster has: without one, ftflow takes
    # the cluster for its own local Ray, which no preemption can reach, and does not watch for them.
    head = start_ray_head(port, secured, "--num-cpus", "0", dashboard=free_port())
    # two training workers, the CPU Ray Data's split of the training stream holds, and a spare
    nodes = [start_node(port, secured, tmp_path / f"node-{n}.log") for n in range(4)]
    driver = {**secured, "RAY_ADDRESS": f"127.0.0.1:{port}", **session_prefect()}
    run_params = params(tiny_model, small_data, str(tmp_path / "store"))
    run_params.storage_shared = True  # every node is on this machine
    # 80 steps: past the second hold, into the second epoch; 64 steps an epoch. No failure allowed: a
    # preemption is not one.
    update = {"num_workers": 2, "cpus_per_worker": 1, "max_steps": 80, "max_failures": 0}
    run_params.train = run_params.train.model_copy(update=update)
    (config := tmp_path / "params.json").write_text(run_params.model_dump_json())
    # Rank 0 holds the run at step 5 while the notice comes (Ray Train's watcher looks every 1 s as ftflow
    # sets it; it is answered at that step).
    hold = {"step": 5, "rank": 0, "hang_s": 6}
    try:
        while alive_nodes(driver) < 5:
            time.sleep(1)
        with faults_injected(hold) as hooks:
            run = subprocess.Popen(
                [FTFLOW, "run", "--verbose", "--params", str(config)],
                cwd=ROOT,
                env=driver,
                stdout=(out := (tmp_path / "out.txt").open("w")),
                stderr=subprocess.STDOUT,
            )
            while not (held := hooks / "hanging-0.json").exists() and run.poll() is None:
                time.sleep(0.2)
            sigterm_at = time.time()
            preempted = node_of_rank_1(nodes, json.loads(held.read_text())["raylet"])
            preempted.send_signal(signal.SIGTERM)
            stop_raylet_once_answered(preempted, tmp_path / "out.txt", run)
            run.wait(timeout=600)
    finally:  # the nodes at once (SIGTERMed, each would wait its drain window on a GCS gone), then the head
        for process in nodes:
            os.killpg(process.pid, signal.SIGKILL)
        os.killpg(head.pid, signal.SIGTERM)
        for process in [*nodes, head]:
            process.wait(timeout=60)
    out.close()
    said = (tmp_path / "out.txt").read_text()
    assert run.returncode == 0, said[-4000:]
    notice = re.search(
        r"a preemption notice for node \w+ \(rank 1\), (\d+) s before its deadline at step 5: "
        r"checkpointed in ([\d.]+) s; training goes on meanwhile",
        said,
    )
    assert notice, said[-4000:]
    assert 0 < int(notice[1]) < DRAIN_S, "answered inside the drain window"
    assert re.search(
        r"lost training worker 1's node to its preemption at step \d+: training goes on from step 5\b", said
    )
    run_dir = re.search(r"artifacts: +(\S+)", said)[1]
    history = storage.read_json(storage.join(run_dir, "manifest.json"))["metrics"]["training"]["history"]
    # on 2 workers again: the spare node's in the lost one's place
    # every row of the first epoch once, and of the second the 16 steps' 512 before max_steps
    summary = [(row["step"], row["resumed_from_step"], row["workers"], row["rows"]) for row in history]
    assert summary == [(64, 5, 2, 2048), (80, 5, 2, 512)]
    assert re.search(r"test accuracy: \d\.\d{4}", said)
    assert time.time() - sigterm_at > DRAIN_S, "the run outlived the node"
