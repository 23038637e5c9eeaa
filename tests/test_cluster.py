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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BATCH_INFER, BUCKET, FTFLOW, free_port
from ray.job_submission import JobStatus, JobSubmissionClient, JobType
from test_flow import check_run, params

from infra.local.stack import HEAD_ENV, ray_head_command
from tasks.core import cluster, jobs, layout, storage

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def start_ray_head(port: int, env: dict[str, str], *args: str, dashboard: int | None = None) -> subprocess.Popen:
    """`ray start --block`: the head's processes end with it, leaving any other Ray alone. With a
    dashboard port, its Job API listens there (on loopback); the Job API needs the head's dashboard
    agent, whose default port the suite's own local Ray already holds."""
    api = (
        [
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard),
            "--dashboard-agent-listen-port",
            str(free_port()),
        ]
        if dashboard
        else ["--include-dashboard", "false"]
    )
    head = subprocess.Popen(
        ray_head_command(port, *api, *(args or ["--num-cpus", "2"])),
        env={**env, **HEAD_ENV},  # stopped at once when the test ends
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
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


def job_api_ready(url: str, token: str) -> None:
    """The Job API answers (the dashboard starts seconds after the head), and only with the token."""
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            break
        except urllib.error.HTTPError:
            break  # up, and refusing a request without the token
        except OSError:
            time.sleep(0.5)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/api/jobs/", timeout=10)
    assert refused.value.code in (401, 403), "the Job API refuses a client without the cluster's token"
    urllib.request.urlopen(
        urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"}), timeout=10
    )


def running_job(client: JobSubmissionClient, prefix: str, status: JobStatus, ignore: set[str] = frozenset()) -> str:
    """The id of the job whose id starts with prefix once it has the status (within 120 s)."""
    for _ in range(240):
        job = next(
            (
                job.submission_id
                for job in client.list_jobs()
                # (a driver that joined the cluster has no submission id)
                if (job.submission_id or "").startswith(prefix)
                and job.submission_id not in ignore
                and job.status == status
            ),
            None,
        )
        if job:
            return job
        time.sleep(0.5)
    raise AssertionError(
        f"no job {prefix}* reached {status}: {[(job.submission_id, job.status) for job in client.list_jobs()]}"
    )


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


@pytest.fixture
def prefect_with_auth(tmp_path) -> Iterator[tuple[str, str]]:
    """A Prefect server apart from the test session's, requiring an API auth string, as a team runs one:
    yields its API URL and the string, once it answers."""
    port, auth = free_port(), f"ftflow:{secrets.token_hex(16)}"
    url = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_API_AUTH_STRING": auth},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(240):  # /api/health answers without credentials: it says only that the server is up
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        assert api(f"{url}/flow_runs/filter")[0] == 401, "an API call without the auth string is refused"
        yield url, auth
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def autoscaling_config(port: int, path: Path) -> Path:
    """Ray's fake multi-node provider (its example.yaml, which the wheel lacks): a head that offers
    no CPU for work and a 3-CPU node type from zero to three nodes, each a separate raylet on this
    machine, removed after ~12 s idle. gcs_address: added nodes join this test's head, not :6379."""
    path.write_text(
        json.dumps(
            {
                "cluster_name": "ftflow-test",
                "max_workers": 3,
                "upscaling_speed": 1.0,
                "idle_timeout_minutes": 0.2,
                "provider": {
                    "type": "fake_multinode",
                    "use_node_id_as_ip": True,
                    "disable_node_updaters": True,
                    "disable_launch_config_check": True,
                    "gcs_address": f"127.0.0.1:{port}",
                },
                "available_node_types": {
                    "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
                    "cpu3": {
                        "resources": {"CPU": 3, "object_store_memory": 300 * 2**20},
                        "node_config": {},
                        "min_workers": 0,
                        "max_workers": 3,
                    },
                },
                "head_node_type": "ray.head.default",
                "auth": {},
                "docker": {},
                "file_mounts": {},
                "cluster_synced_files": [],
                "file_mounts_sync_continuously": False,
                "rsync_exclude": [],
                "rsync_filter": [],
                "initialization_commands": [],
                "setup_commands": [],
                "head_setup_commands": [],
                "worker_setup_commands": [],
                "head_start_ray_commands": [],
                "worker_start_ray_commands": [],
            }
        )
    )
    return path


def alive_nodes(env: dict[str, str]) -> int:
    count = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray; ray.init(log_to_driver=False); print('alive:', sum(n['Alive'] for n in ray.nodes()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(re.search(r"^alive: (\d+)$", count.stdout, re.M)[1])


def refused_before_any_work(port: int, url: str, joined: dict[str, str], finetune, tmp_path: Path) -> None:
    """A driver without the token, Ray Client, and a local storage root (joined, and as jobs): each
    refused in one line, saying what to use, before any work."""
    stranger = subprocess.run(
        [sys.executable, "-c", f"from tasks.core import cluster; cluster.connect('127.0.0.1:{port}')"],
        cwd=ROOT,
        env=without_secrets(os.environ, tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stranger.returncode != 0
    assert f"the Ray cluster at 127.0.0.1:{port} refused this driver's token" in stranger.stderr.splitlines()[-1]
    with pytest.raises(ValueError, match=r"^ray_address ray://127.0.0.1:10001: Ray Client cannot run ftflow's stages"):
        cluster.connect("ray://127.0.0.1:10001")
    with pytest.raises(
        ValueError, match=r"^storage_root /x is a local path, but the stages run as Ray Jobs on the cluster at "
    ):
        cluster.refuse_local_paths({"storage_root": ["/x"]}, False, url)
    time.sleep(3)  # the autoscaler's first report, by which a driver knows it is there
    refused = finetune(str(tmp_path / "local-store"), joined)
    assert refused.returncode != 0 and not (tmp_path / "local-store").exists()
    assert (
        f"storage_root {tmp_path / 'local-store'} is a local path, but the Ray cluster has 1 node(s) and an "
        "autoscaler that adds more, which do not all share this machine's disk"
    ) in refused.stderr, refused.stderr[-3000:]


def stopped_with_its_flow_run(client: JobSubmissionClient, config: Path, env: dict[str, str]) -> str:
    """A flow run stopped mid-training (Prefect cancels one with SIGTERM) stops its job on the cluster."""
    cancelled = subprocess.Popen(
        [FTFLOW, "run", "--verbose", "--params", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    training = running_job(
        client, "ftflow-fit-", JobStatus.RUNNING, ignore={job.submission_id for job in client.list_jobs()}
    )
    cancelled.send_signal(signal.SIGTERM)
    assert cancelled.wait(timeout=60) != 0
    assert running_job(client, training, JobStatus.STOPPED), "the flow's job was stopped with it"
    return training


def gpu_requests_fail_within_their_wait(finetune, joined: dict, outside: dict, model: Path, test_uri: str) -> None:
    """Requests no node type can satisfy (a GPU), in training (a driver that joined) and in batch
    inference (as a job, its refusal raised again as the same line): each fails once its wait runs out,
    saying what did not come, and is not tried again."""
    # The two side by side: each is mostly its command's start (37 s one after the other).
    no_actors = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"{BATCH_INFER}, device='gpu', wait_for_actors_s=5))",
            str(model),
            test_uri,
            f"s3://{BUCKET}/labels",
        ],
        cwd=ROOT,
        env=outside,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    never = finetune(f"s3://{BUCKET}/grows", joined, device="gpu", wait_for_workers_s=5)  # tokenized: trains at once
    assert never.returncode != 0
    assert (
        "the Ray cluster did not make room for 2 training worker(s) of 2 CPU and 1 GPU each within wait_for_workers_s=5"
    ) in never.stderr, never.stderr[-3000:]
    stderr = no_actors.communicate(timeout=300)[1]
    assert no_actors.returncode != 0 and not storage.exists(f"s3://{BUCKET}/labels/{layout.MARKER}")
    assert (
        "the Ray cluster did not start 1 inference actor(s) of 1 CPU and 1 GPU each within wait_for_actors_s=5"
        in stderr
    ), stderr[-3000:]
    assert " - Retry 1/" not in stderr, "a wait that ran out is not tried again"  # 4 tries took 70 s


@dataclass(frozen=True)
class Head:
    port: int
    url: str  # its Job API
    token: str
    env: dict[str, str]  # the cluster's: its S3 credentials, its token, and the `python` that runs a job


@pytest.fixture
def autoscaling_head(tmp_path) -> Iterator[Head]:
    """The head of an autoscaling cluster that requires a token, its Job API on loopback. Asked for before
    prefect_with_auth, so that its dashboard starts while that server does (~8 s of each, side by side)."""
    port, dashboard, token = free_port(), free_port(), secrets.token_hex(32)
    secured = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "PATH": f"{BIN}:{os.environ['PATH']}"}
    head = start_ray_head(
        port,
        {**secured, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
        "--num-cpus",
        "0",
        "--autoscaling-config",
        str(autoscaling_config(port, tmp_path / "cluster.json")),
        dashboard=dashboard,
    )
    try:
        yield Head(port, f"http://127.0.0.1:{dashboard}", token, secured)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def test_finetune_as_ray_jobs_on_a_token_secured_cluster_that_grows_and_shrinks(
    tiny_model, s3_data, tmp_path, autoscaling_head, prefect_with_auth
):
    """An autoscaling cluster at rest, a head alone that takes no work, that requires a token, driven
    from outside through its Job API as a laptop or a Prefect worker would: every stage's Ray work runs
    there as a Ray Job, its lines followed into the flow run's log, its refusals raised again as the
    same one line, and stopped with the flow run; the driver never joins Ray. The flow asks for two
    training workers of 2 CPUs and two inference actors; the autoscaler adds 3-CPU nodes (separate
    raylets), training workers land on different nodes, every artifact in S3 is complete and free of
    the token and of the auth string of the Prefect server the flows report to, and the nodes go once
    idle. Refused before any work: a driver without the token, Ray Client, a local storage root; a
    request no node type can satisfy (a GPU) fails within its wait."""
    port, url, token = autoscaling_head.port, autoscaling_head.url, autoscaling_head.token
    prefect_url, auth = prefect_with_auth
    team = {**autoscaling_head.env, "PREFECT_API_URL": prefect_url, "PREFECT_API_AUTH_STRING": auth}
    joined = {**team, "RAY_ADDRESS": f"127.0.0.1:{port}"}  # a driver on the cluster's network
    outside = {**team, "RAY_ADDRESS": url}  # ftflow's commands, from outside the cluster
    config = tmp_path / "params.json"

    def finetune(root: str, env: dict[str, str], **train: object) -> subprocess.CompletedProcess:
        run_params = params(tiny_model, s3_data, root, epochs=1)
        run_params.train = run_params.train.model_copy(update={"num_workers": 2, "cpus_per_worker": 2, **train})
        run_params.inference.actors = 2
        config.write_text(run_params.model_dump_json())
        return subprocess.run(
            [FTFLOW, "run", "--verbose", "--params", str(config)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    job_api_ready(url, token)
    refused_before_any_work(port, url, joined, finetune, tmp_path)
    client = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})
    drivers = {job.job_id for job in client.list_jobs()}  # the refused driver joined the cluster
    run = finetune(f"s3://{BUCKET}/grows", outside)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    training = stopped_with_its_flow_run(client, config, outside)
    jobs = [job for job in client.list_jobs() if job.job_id not in drivers and job.submission_id != training]
    # While the added nodes idle out (they go ~20 s after their last work):
    gpu_requests_fail_within_their_wait(finetune, joined, outside, tiny_model, s3_data["test"])
    for _ in range(40):
        if (alive := alive_nodes(joined)) == 1:
            break
        time.sleep(2)
    assert alive == 1, "the added nodes went once idle"
    status, runs = api(f"{prefect_url}/flow_runs/filter", auth)
    assert status == 200 and [r["state_type"] for r in runs].count("COMPLETED") == 1, runs
    run_dir = re.search(r"artifacts: +(\S+)", run.stdout)[1]
    accuracy = storage.read_json(storage.join(run_dir, "metrics.json"))["accuracy"]
    assert f"test accuracy: {accuracy:.4f}" in run.stdout
    manifest = check_run(run_dir, accuracy, s3_data, epochs=1)
    assert len(set(manifest["metrics"]["training"]["nodes"])) == 2, "one worker per added node: 2 CPUs each, 3 per node"
    # The head reports the machine's address; its port says which cluster the run used.
    assert manifest["cluster"]["gcs_address"].endswith(f":{port}"), "the run used the cluster it was pointed at"
    fs, stored = storage.filesystem(f"s3://{BUCKET}/grows")
    for secret in (token, auth.split(":")[1]):
        assert secret not in run.stdout + run.stderr and all(
            secret.encode() not in fs.cat_file(k) for k in fs.find(stored)
        )
    check_jobs(jobs, run.stderr, url)


def check_jobs(jobs: list, log: str, url: str) -> None:
    """Every Ray driver of the two runs was a job the flow submitted, and their lines reached the log."""
    assert {job.type for job in jobs} == {JobType.SUBMISSION}  # a driver joining the cluster is listed too
    stages = sorted(job.submission_id.split("-")[1] for job in jobs if job.status == JobStatus.SUCCEEDED)
    # The plan is checked by both runs (the cancelled one's too, before its training started). Evaluation
    # and the test split's batch inference read the labels the job `fit` gave the test split: no job of
    # their own.
    assert stages == ["check_plan", "check_plan", "fit", "tokenized_shards"], [
        (j.submission_id, j.status, j.message) for j in jobs
    ]
    for stage in stages:
        assert re.search(rf"{stage} runs as Ray job ftflow-{stage}-\w+ on {url}", log)
    # The stages' own lines, from the jobs' logs, in the flow run's log (as Prefect prints it) as they came.
    assert re.search(r"Task run 'train-\w+' - training on 2 CPU worker", log), log[-3000:]
    assert re.search(r"Task run 'tokenize-\w+' - tokenized \{'train': 2048", log)
    assert re.search(r"Task run 'train-\w+' - train: 10 / \d+ steps, epoch ", log), (
        "the training's ticks came back on the job's log"
    )
    assert "WebSocket closed" not in log


def test_a_fit_on_the_local_ray_starts_no_placement_group_cleaner(ray_cluster, tmp_path):
    """The local Ray ftflow starts runs no dashboard, so no state API, which Ray Train's placement-group
    cleaner asks every second whether the controller lives: there it could never know, and its stop
    held every fit() 12 s at its end. ftflow's Trainer leaves it out there (and only there)."""
    from ray._private import state
    from ray.train import RunConfig, ScalingConfig

    from tasks.train.trainer import Trainer

    def cleaners() -> int:
        return sum("PlacementGroupCleaner" in actor["ActorClassName"] for actor in state.actors().values())

    before = cleaners()
    Trainer(
        lambda: None, scaling_config=ScalingConfig(num_workers=1), run_config=RunConfig(storage_path=str(tmp_path))
    ).fit()
    assert cleaners() == before


def test_a_jobs_result_behind_a_progress_bar_on_its_line_is_read():
    """Ray Data's progress bars share the job driver's stdout and end without a newline: the result
    line came after one (seen on the 3-node cluster above, whose run then failed for want of it)."""
    bar = " " * 40 + "\x1b[A" * 5
    assert jobs.ours(bar + jobs.RESULT + '{"rows": 3}') == jobs.RESULT + '{"rows": 3}'
    assert jobs.ours(bar + "ftflow WARNING the plan changed") == "ftflow WARNING the plan changed"
    assert jobs.ours("\x1b[2m(pid=3332)\x1b[0m - split(2, equal=True): 100%") is None
