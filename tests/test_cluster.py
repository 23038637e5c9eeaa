"""ftflow driving a Ray cluster and a Prefect server started apart from it, as a team runs it on a
real cluster, each requiring its secret: Ray a token, Prefect an API auth string. A client without
the secret is refused; ftflow with it runs; the secret reaches no log, manifest or artifact."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import BUCKET, free_port, write_jsonl
from tasks import storage
from test_flow import check_run, params

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def start_ray_head(port: int, env: dict[str, str]) -> subprocess.Popen:
    """`ray start --block`: the head's processes end with it, leaving any other Ray alone."""
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(240):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return head
        time.sleep(0.25)
    raise RuntimeError(f"no Ray head listening on 127.0.0.1:{port}")


def without_secrets(env: dict[str, str], home: Path) -> dict[str, str]:
    """A client that truly has no Ray token: none in its environment, none in its home folder."""
    home.mkdir(exist_ok=True)
    clean = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    return {**clean, "HOME": str(home), "RAY_gcs_server_port_wait_time_s": "2"}  # refused in ~2 s, not 20


def stored_text(root: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in root.rglob("*") if path.is_file())


def test_finetune_joins_a_ray_cluster_that_requires_a_token(tiny_model, small_data, tmp_path):
    port, token = free_port(), secrets.token_hex(32)
    secured = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    head = start_ray_head(port, secured)
    try:
        stranger = subprocess.run([sys.executable, "-c", f"from tasks import cluster; cluster.connect('127.0.0.1:{port}')"],
                                  cwd=ROOT, env=without_secrets(os.environ, tmp_path / "home"), capture_output=True,
                                  text=True, timeout=120)
        assert stranger.returncode != 0
        assert f"the Ray cluster at 127.0.0.1:{port} refused this driver's token" in stranger.stderr.splitlines()[-1]

        config = tmp_path / "params.json"
        config.write_text(params(tiny_model, small_data, str(tmp_path / "store")).model_dump_json())
        run = subprocess.run([sys.executable, "-m", "flows.finetune", str(config)], cwd=ROOT,
                             env={**secured, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True, timeout=900)
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
    assert token not in run.stdout + run.stderr + stored_text(tmp_path / "store")


def api(url: str, auth: str | None = None, body: dict | None = None) -> tuple[int, object]:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, None


def test_flows_run_against_a_prefect_server_that_requires_an_auth_string(tiny_model, tmp_path):
    port, auth = free_port(), f"ftflow:{secrets.token_hex(16)}"
    url = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_API_AUTH_STRING": auth},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(240):  # /api/health answers without credentials: it says only that the server is up
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        assert api(f"{url}/flow_runs/filter")[0] == 401, "an API call without the auth string is refused"

        write_jsonl(tmp_path / "corpus" / "reviews.jsonl", [{"text": f"review {i}"} for i in range(50)])
        labels = tmp_path / "labels"
        run = subprocess.run(
            [sys.executable, "-c", "import sys; from flows.batch_infer import batch_infer; batch_infer(*sys.argv[1:])",
             str(tiny_model), str(tmp_path / "corpus"), str(labels)],
            cwd=ROOT, env={**os.environ, "PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth},
            capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        status, runs = api(f"{url}/flow_runs/filter", auth)
        assert status == 200 and [r["state_type"] for r in runs] == ["COMPLETED"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert storage.read_json(str(labels / storage.MARKER))["rows"] == 50
    assert auth.split(":")[1] not in run.stdout + run.stderr + stored_text(labels)


def test_finetune_on_several_nodes_with_storage_in_s3(tiny_model, small_data, s3_endpoint, tmp_path):
    """A head and two worker nodes (separate raylets) on this machine: the training workers land on
    different nodes, every artifact in S3 is complete; a local storage root is refused up front."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})  # the head: Ray Data's CPU
    workers = [nodes.add_node(num_cpus=2) for _ in range(2)]  # each fits one worker of 1.5 CPUs, not two
    env = {**os.environ, "RAY_ADDRESS": nodes.address}

    def finetune(root: str) -> subprocess.CompletedProcess:
        config = tmp_path / "params.json"
        run_params = params(tiny_model, small_data, root)
        run_params.train.cpus_per_worker = 1.5
        config.write_text(run_params.model_dump_json())
        return subprocess.run([sys.executable, "-m", "flows.finetune", str(config)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
    try:
        refused = finetune(str(tmp_path / "local-store"))
        assert refused.returncode != 0 and not (tmp_path / "local-store").exists()
        assert "storage_root " + str(tmp_path / "local-store") + " is a local folder, but the Ray cluster has 3 node(s)" in refused.stderr

        run = finetune(f"s3://{BUCKET}/several-nodes")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        nodes.shutdown()
    run_dir = re.search(r"artifacts: +(\S+)", run.stdout)[1]
    manifest = check_run(run_dir, {"test_accuracy": storage.read_json(storage.join(run_dir, "metrics.json"))["accuracy"]},
                         small_data)
    assert sorted(manifest["metrics"]["training"]["nodes"]) == sorted(node.node_id for node in workers)
    assert manifest["cluster"]["nodes"] == 3
