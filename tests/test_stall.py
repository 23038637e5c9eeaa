"""The stall report (tasks/train/stall.py) on the session's local Ray, which runs no dashboard: a worker blocked in
a function of a recognisable name, and a crashed one. py-spy reaches the blocked worker on its node, and no
credential reaches the folder, not even one the crashed worker printed to its log."""

from __future__ import annotations

import json
import os
import time

from tasks.train import stall
from tasks.train.stall import Process, report, top_frame
from tasks.train.stall_node import REDACTED

SECRET = "hf_stall-test-secret-0123456789"
ENV = {"env_vars": {"HF_HOME": "/tmp/ftflow-stall-hf-home", "HF_TOKEN": SECRET}}


def test_report_names_the_frame_a_worker_waits_in_and_keeps_its_secrets(ray_cluster, tmp_path, monkeypatch):
    ray = ray_cluster
    marker = tmp_path / "blocked"

    # Defined here, not at module level: Ray ships them by value, the workers need not import the tests.
    def waits_for_a_collective() -> None:
        marker.write_text(f"{os.getpid()} {ray.get_runtime_context().get_node_id()}")
        time.sleep(600)

    class Crashes:
        def crash(self) -> None:
            print(f"crashing with HF_TOKEN={os.environ['HF_TOKEN']}", flush=True)
            os._exit(1)

    blocked = ray.remote(num_cpus=0, max_retries=0)(waits_for_a_collective).options(runtime_env=ENV).remote()
    crashed = ray.remote(num_cpus=0)(Crashes).options(runtime_env=ENV).remote()
    try:
        ray.get(crashed.crash.remote())
    except ray.exceptions.ActorDiedError:
        pass
    for _ in range(300):
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.1)
    pid, node = marker.read_text().split()
    rank0 = Process(what="rank 0", node_id=node, pid=int(pid))
    folder = tmp_path / "stall" / "run-1"
    try:
        started = time.monotonic()
        frame = report(str(folder), [rank0], stuck=rank0)
        took = time.monotonic() - started
        monkeypatch.setattr(stall, "NODE_TIMEOUT_S", 0)  # no node answers in no time
        assert report(str(tmp_path / "stall" / "silent"), [rank0], stuck=rank0) == ""
    finally:
        ray.cancel(blocked, force=True)
    print(f"report() took {took:.1f} s")
    assert took < 30

    assert "waits_for_a_collective" in frame
    assert "waits_for_a_collective" in (folder / "stacks" / "rank-0.txt").read_text()  # py-spy attached
    cluster = json.loads((folder / "cluster.json").read_text())
    assert cluster["total"]["CPU"] == ray.cluster_resources()["CPU"]
    assert node in [n["node_id"] for n in cluster["nodes"]]
    environment = json.loads((folder / "environment.json").read_text())["rank 0"]
    assert environment["HF_HOME"] == ENV["env_vars"]["HF_HOME"] and environment["HF_TOKEN"] == REDACTED

    died = [d for d in json.loads((folder / "dead.json").read_text()) if d["name"].startswith("Crashes-")]
    assert died and died[0]["death_cause"]["actor_died_error_context"]["reason"] == "WORKER_DIED"
    assert f"crashing with HF_TOKEN={REDACTED}" in (folder / "logs" / f"{died[0]['name']}.out").read_text()

    readme = (folder / "README.md").read_text()
    assert "stacks/rank-0.txt" in readme and "nvidia-smi" in readme  # its output, or why there is none
    assert f"node {node}: did not answer in 0 s" in (tmp_path / "stall" / "silent" / "README.md").read_text()
    files = [f for f in (tmp_path / "stall").rglob("*") if f.is_file()]
    assert not [f for f in files if SECRET.encode() in f.read_bytes()]


def test_the_top_frame_is_the_training_threads():
    """Ray Train V2 runs the training function in a thread of its own; its main thread waits in Ray's loop."""
    text = """Process 11632: ray::RayTrainWorker.run_train_fn
Python v3.11.7 (/usr/bin/python3.11)

Thread 11632 (idle): "MainThread"
    Worker.main_loop (ray/_private/worker.py:1069)
    <module> (ray/_private/workers/default_worker.py:323)
Thread 11700 (idle): "Dummy-2"
Thread 11705 (active): "TrainingThread(train_fn_with_final_checkpoint_flush)"
    all_reduce (torch/distributed/distributed_c10d.py:2810)
    train_fn (tasks/train/worker.py:120)
"""
    assert top_frame(text) == "all_reduce (torch/distributed/distributed_c10d.py:2810)"
    assert top_frame(text.split("Thread 11700")[0]) == "Worker.main_loop (ray/_private/worker.py:1069)"
    assert top_frame("") == ""
