"""The flow on a Ray cluster started apart from it (`ray start --head`), joined through RAY_ADDRESS,
as a team runs it on a real cluster: not a Ray the flow starts in its own process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port
from tasks import storage
from test_flow import check_run, params

ROOT = Path(__file__).resolve().parents[1]


def start_ray_head(port: int) -> subprocess.Popen:
    """`ray start --block`: the head's processes end with it, leaving any other Ray alone."""
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(240):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return head
        time.sleep(0.25)
    raise RuntimeError(f"no Ray head listening on 127.0.0.1:{port}")


def test_finetune_joins_a_separately_started_ray_cluster(tiny_model, small_data, tmp_path):
    port = free_port()
    head = start_ray_head(port)
    try:
        config = tmp_path / "params.json"
        config.write_text(params(tiny_model, small_data, str(tmp_path / "store")).model_dump_json())
        env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        run = subprocess.run([sys.executable, "-m", "flows.finetune", str(config)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)

    run_dir = re.search(r"artifacts: +(\S+)", run.stdout)[1]
    accuracy = storage.read_json(storage.join(run_dir, "metrics.json"))["accuracy"]
    assert f"test accuracy: {accuracy:.4f}" in run.stdout
    manifest = check_run(run_dir, {"test_accuracy": accuracy}, small_data)
    # The head reports the machine's address; its port says which cluster the run used.
    assert manifest["cluster"]["gcs_address"].endswith(f":{port}"), "the run used the cluster it was pointed at"
