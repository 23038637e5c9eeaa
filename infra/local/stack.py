"""The local stack: a Prefect server on 127.0.0.1, a Ray head, and the runner serving ftflow's
deployments (deployments/serve.py), each a process of its own that outlives this command.

    make stack-up     # start what is not running yet; prints the UI and the addresses to use
    make stack-down   # stop the runner (no new runs), then the Ray head, then the server

State lives in .stack/ (FTFLOW_STACK_DIR): each process's pid and log, and the server's database.
Ports: FTFLOW_PREFECT_PORT (4200) and FTFLOW_RAY_PORT (6379). The Prefect server listens on
127.0.0.1 only; Ray's ports listen on every interface whatever address it is given, so the head
requires a token, made for the stack in .stack/ray-auth-token (readable by its owner only).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tasks.core.cluster import machine_cpus

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("FTFLOW_STACK_DIR", PROJECT_ROOT / ".stack"))
PREFECT_PORT = int(os.environ.get("FTFLOW_PREFECT_PORT", "4200"))
RAY_PORT = int(os.environ.get("FTFLOW_RAY_PORT", "6379"))
UI = f"http://127.0.0.1:{PREFECT_PORT}"


def console_script(name: str) -> str:
    """Ray's or Prefect's command: beside this interpreter (its virtual environment's), else on PATH
    (a Python given them by PYTHONPATH, as bench/gpu's machine is)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)


RAY = [console_script("ray")]
PREFECT = [console_script("prefect")]
READY_S = 120


RAY_TOKEN = STATE / "ray-auth-token"


def ray_token() -> Path:
    """The stack's Ray token: made once, readable by this user only (Ray's own ~/.ray/auth_token is
    created readable by every user of the machine)."""
    if not RAY_TOKEN.exists():
        with os.fdopen(os.open(RAY_TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
    return RAY_TOKEN


def stack_env() -> dict[str, str]:
    return {
        # The runner asks the local server for runs to start every 2 s, not Prefect's 10: a run triggered
        # from the UI or by an event starts within 2 s. A user's own setting wins.
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        # The server's SQLite refuses a write that meets another at once ("database is locked", a 503 the
        # UI shows as "Something went wrong trying to create a flow run"); Prefect leaves it out of the
        # server's log unless told: .stack/prefect-server.log says why.
        "PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true",
        **os.environ,
        "PREFECT_HOME": str(STATE / "prefect"),  # the server's database stays with the stack
        "PREFECT_API_URL": f"{UI}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_ADDRESS": f"127.0.0.1:{RAY_PORT}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(RAY_TOKEN),
        **HEAD_ENV,
    }


# `ray start --block` marks its node draining on SIGTERM and waits up to 30 s (Ray 2.60's default, for
# Serve's proxies to finish their requests) before stopping it: nothing here serves traffic, and
# `ftflow stack down` took 41 s, 35 of them the head's.
HEAD_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def ray_head_command(port: int, *options: str) -> list[str]:
    """`ray start --head` in the foreground, on this machine's loopback: the stack's head (and the
    tests' clusters). `--block` keeps it in the foreground and takes the head's processes down with
    it on SIGTERM."""
    return [
        *RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-usage-stats",
        *options,
    ]


# (name, command): started in this order, stopped in the reverse one. `ray start --block` stays in
# the foreground and takes the head's processes down with it on SIGTERM, so stopping it never
# touches other Ray clusters on the machine (`ray stop` would stop every one).
PROCESSES = [
    ("prefect-server", [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(PREFECT_PORT)]),
    # As the local Ray `ftflow run` starts: one CPU more than the machine has, for Ray Data's tasks.
    # With the cores alone, training took 1 worker of 1 CPU on a 2-core machine, and its epoch ran
    # 171 s against 128 s for `ftflow run` alone (bench/end_to_end.py).
    ("ray-head", ray_head_command(RAY_PORT, "--num-cpus", str(machine_cpus()), "--include-dashboard", "false")),
    ("runner", [sys.executable, "-m", "deployments.serve"]),
]


def running(name: str) -> int | None:
    """The pid of the stack's process `name`, if it is alive."""
    pidfile = STATE / f"{name}.pid"
    if not pidfile.exists():
        return None
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def start(name: str, command: list[str]) -> None:
    if running(name):
        print(f"{name}: already running")
        return
    with open(STATE / f"{name}.log", "ab") as log:
        # A session of its own: the process outlives this command and its terminal.
        process = subprocess.Popen(
            command,
            cwd=PROJECT_ROOT,
            env=stack_env(),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    (STATE / f"{name}.pid").write_text(str(process.pid))
    print(f"{name}: started (pid {process.pid}, log {STATE / f'{name}.log'})")


def wait_until(ready, what: str) -> None:
    deadline = time.monotonic() + READY_S
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready after {READY_S} s: see the logs in {STATE}")
        time.sleep(0.5)


def server_ready() -> bool:
    try:
        return urllib.request.urlopen(f"{UI}/api/health", timeout=2).status == 200
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def deployments_ready() -> bool:
    """The runner has registered its deployments with the server."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{UI}/api/deployments/filter", data=b"{}", headers={"Content-Type": "application/json"}
            ),
            timeout=5,
        ) as reply:
            return b'"retrain"' in reply.read()
    except OSError:
        return False


def up() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    ray_token()
    ready = {"prefect-server": server_ready, "ray-head": lambda: port_open(RAY_PORT), "runner": deployments_ready}
    for name, command in PROCESSES:
        start(name, command)
        wait_until(ready[name], name)
    print(
        f"\nPrefect UI:      {UI}\nPREFECT_API_URL: {UI}/api\nRAY_ADDRESS:     127.0.0.1:{RAY_PORT}"
        f"\nRay's token:     RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={RAY_TOKEN}"
    )


def stop(name: str, grace_s: float = 60) -> None:
    """SIGTERM to the process's session (it and what it started), SIGKILL after grace_s."""
    pid = running(name)
    if pid:
        os.killpg(pid, signal.SIGTERM)
        started = time.monotonic()
        while running(name) and time.monotonic() < started + grace_s:
            time.sleep(0.2)
        killed = bool(running(name))
        if killed:
            os.killpg(pid, signal.SIGKILL)
        print(f"{name}: {'killed after' if killed else 'stopped in'} {time.monotonic() - started:.1f} s")
    (STATE / f"{name}.pid").unlink(missing_ok=True)


def forget_ray_head() -> None:
    """A head started by `ray start` leaves its address in a file for a plain `ray.init()` on this
    machine to join; once the head is stopped, that file would make such a `ray.init()` hang."""
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if current.exists() and current.read_text().strip().endswith(f":{RAY_PORT}"):
        current.unlink()


def down() -> None:
    for name, _ in reversed(PROCESSES):
        stop(name)
    forget_ray_head()


if __name__ == "__main__":
    commands = {"up": up, "down": down}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: {sys.argv[0]} up|down")
    commands[sys.argv[1]]()
