"""`ftflow doctor` as a person runs it, on this CPU machine: every check passes or says why it is
skipped (no GPU); a cluster that does not answer and a storage root that cannot be written fail
with exit code 1, each saying what to fix."""

from __future__ import annotations

import re

from conftest import free_port
from test_cli import ftflow

CHECKS = ["ray", "train", "all-reduce", "bf16", "deepspeed ops", "storage", "prefect"]


def checks_and_log(stdout: str) -> tuple[dict[str, str], list[str]]:
    """{check: its line} in the order printed, and the lines that are not checks."""
    lines = stdout.splitlines()
    checks = {match[1]: line for line in lines if (match := re.match(r"[✓!\-✗] ([a-z0-9 -]+): ", line))}
    return checks, [line for line in lines if line not in checks.values()]


def test_every_check_passes_on_a_cpu_machine_with_the_gpu_ones_skipped(tmp_path):
    store = tmp_path / "store"
    run = ftflow("doctor", "--storage-root", str(store), timeout=300, XDG_STATE_HOME=str(tmp_path / "state"))
    assert run.returncode == 0 and run.stderr == "", run.stdout + run.stderr
    checks, others = checks_and_log(run.stdout)
    assert list(checks) == CHECKS, run.stdout
    # Ray's and DeepSpeed's output: in the log, in the user's state folder (not /tmp)
    [log] = (tmp_path / "state" / "ftflow" / "logs").iterdir()
    assert others == [f"logs: {log}"] and "(RayTrainWorker pid=" in log.read_text(), run.stdout
    assert re.fullmatch(r"✓ ray: 1 node, \d+ CPUs, 0 GPUs at \S+", checks["ray"])
    assert re.fullmatch(
        r"✓ train: one DeepSpeed step \(ZeRO-0, fp32\) of a tiny BERT on 2 CPU worker\(s\): loss \d+\.\d{4}",
        checks["train"],
    )
    assert checks["all-reduce"] == "✓ all-reduce: 2 workers over gloo, tensors on cpu: sum 3 as expected"
    assert checks["bf16"] == "- bf16: skip: no GPU"
    # Prebuilt, built by an earlier run, or to be built by the first offloaded run: never built here.
    assert re.match(
        r"(✓ deepspeed ops: CPU Adam .* is (prebuilt|built)|! deepspeed ops: CPU Adam .* is not prebuilt: .*DS_BUILD_CPU_ADAM=1)",
        checks["deepspeed ops"],
    )
    assert checks["storage"] == f"✓ storage: {store} is writable"
    assert (
        checks["prefect"] == "✓ prefect: PREFECT_API_URL is not set: each run starts a temporary local Prefect server"
    )


def test_a_cluster_that_does_not_answer_and_a_storage_root_under_a_file_fail_saying_what_to_fix(tmp_path):
    (tmp_path / "a-file").write_text("")
    nobody = f"http://127.0.0.1:{free_port()}"
    run = ftflow("doctor", "--ray-address", nobody, "--storage-root", str(tmp_path / "a-file" / "store"))
    assert run.returncode == 1 and run.stderr == "", run.stdout + run.stderr
    checks, _ = checks_and_log(run.stdout)
    assert list(checks) == CHECKS, run.stdout
    assert (
        checks["ray"].startswith(f"✗ ray: ConnectionError: Failed to connect to Ray at address: {nobody}")
        and "; fix: start the cluster" in checks["ray"]
    )
    assert all(
        checks[name] == f"- {name}: skip: not checked: the cluster failed the check above" for name in CHECKS[1:5]
    )
    assert checks["storage"] == (
        f"✗ storage: storage_root {tmp_path / 'a-file' / 'store'}: {tmp_path / 'a-file'} is a file, not a folder; "
        "fix: set --storage-root (or FTFLOW_STORAGE_ROOT) to a folder or s3://bucket/prefix this machine can write"
    )
