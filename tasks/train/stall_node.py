"""What a stall report (tasks/train/stall.py) gathers on each node that holds a process of the run,
in one Ray task per node: py-spy stacks, the processes' settings (secrets redacted), their log
tails, nvidia-smi. Each part is Probed: a part that fails is a line of the report, never an error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel

COMMAND_TIMEOUT_S = 10.0  # py-spy, nvidia-smi: either can hang on a wedged process or GPU
TAIL_LINES, TAIL_BYTES = 50, 64 * 1024  # the end of a log file, read without reading all of it
SETTINGS = ("NCCL_", "CUDA_", "HF_", "TORCH_NCCL_")  # what decides how collectives, devices and the hub behave
SECRET = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)
REDACTED = "<redacted>"
MIN_SECRET_CHARS = 8  # shorter values of secret-named settings ("1", "true") would blank unrelated text
PTRACE_HINT = (
    "py-spy needs ptrace rights over Ray's workers: run it as root, or give the container the SYS_PTRACE "
    "capability (Kubernetes: securityContext.capabilities.add: [SYS_PTRACE]); under kernel.yama.ptrace_scope >= 1 "
    "an unprivileged user may not trace a process that is not its child, and --nonblocking needs the same rights"
)


class Probed(BaseModel):
    """One part of what a node sees: its value, or why it could not be had."""

    value: Any = None
    error: str | None = None


class NodeReport(BaseModel):
    """What on_node sends back: each part Probed, by what (or name) it is of."""

    stacks: dict[str, Probed]  # py-spy dumps, text
    environs: dict[str, Probed]  # the processes' settings, {name: value}
    logs: dict[str, Probed]  # log tails, {"out" | "err": text}
    secrets: list[str]  # the secret settings' values met, for the driver to cut
    nvidia_smi: Probed | None = None


@ray.remote(num_cpus=0, max_retries=0)
def on_node(stacks: dict[str, int], environs: dict[str, int], logs: dict[str, int], gpu: bool) -> NodeReport:
    """What only this node sees, each part Probed: py-spy stacks of `stacks` (what: pid),
    the settings of `environs`, the log tails of `logs` (name: pid), nvidia-smi when `gpu`; and the values of the
    secret settings met (in this task's own environment and the processes'), for the driver to cut from what it
    writes. The commands run side by side: each may wait COMMAND_TIMEOUT_S."""
    with ThreadPoolExecutor(max_workers=len(stacks) + 1) as pool:
        dumps = {what: pool.submit(attempt, py_spy, pid) for what, pid in stacks.items()}
        smi = pool.submit(attempt, nvidia_smi) if gpu else None
        environments = {what: attempt(read_environ, pid) for what, pid in (stacks | environs).items()}
        met = {value for environment in environments.values() for value in secret_values(environment.value or {})}
        return NodeReport(
            environs={
                what: attempt(settings, environments[what].value)
                if environments[what].error is None
                else environments[what]
                for what in environs
            },
            logs={name: attempt(log_tails, pid) for name, pid in logs.items()},
            secrets=sorted(secret_values(os.environ) | met),
            stacks={what: dump.result() for what, dump in dumps.items()},
            nvidia_smi=smi.result() if smi else None,
        )


def attempt(function: Callable, *args: Any) -> Probed:
    try:
        return Probed(value=function(*args))
    except Exception as error:  # noqa: BLE001 -- a probe that fails is a line of the stall report
        return Probed(error=f"{type(error).__name__}: {error}")


def py_spy(pid: int) -> str:
    """`py-spy dump` of pid, by the py-spy of this worker's own environment (ray[default] installs it)."""
    beside = Path(sys.executable).with_name("py-spy")
    binary = str(beside) if beside.exists() else shutil.which("py-spy")
    if not binary:
        raise FileNotFoundError(f"no py-spy beside {sys.executable} or on PATH (it comes with ray[default])")
    # RUST_BACKTRACE=0: py-spy's own backtrace would bury its one-line reason.
    done = subprocess.run(
        [binary, "dump", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env={**os.environ, "RUST_BACKTRACE": "0"},
    )
    if done.returncode:
        reason = " ".join(done.stderr.split())
        raise RuntimeError(f"{reason} ({PTRACE_HINT})" if "ermission" in reason else reason)
    return done.stdout


def nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        raise FileNotFoundError("nvidia-smi is not installed on this node")
    done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(" ".join((done.stdout + done.stderr).split()))
    return done.stdout


def read_environ(pid: int) -> dict[str, str]:
    """The environment pid started with."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def settings(environment: dict[str, str]) -> dict[str, str]:
    return {
        name: REDACTED if SECRET.search(name) else value
        for name, value in sorted(environment.items())
        if name.startswith(SETTINGS)
    }


def secret_values(environment: Mapping[str, str]) -> set[str]:
    return {value for name, value in environment.items() if SECRET.search(name) and len(value) >= MIN_SECRET_CHARS}


def log_tails(pid: int) -> dict[str, str]:
    """The last lines of pid's worker-<id>-<job>-<pid>.out and .err in this node's Ray session logs (the newest
    of each, should the pid have been reused)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())  # no public call names it
    tails = {}
    for suffix in ("out", "err"):
        found = sorted(logs.glob(f"worker-*-{pid}.{suffix}"), key=lambda path: path.stat().st_mtime)
        if found:
            tails[suffix] = tail(found[-1])
    if not tails:
        raise FileNotFoundError(f"no worker-*-{pid}.out or .err under {logs}")
    return tails


def tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
        return b"\n".join(f.read().splitlines()[-TAIL_LINES:]).decode(errors="replace") + "\n"
