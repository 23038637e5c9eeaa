"""Prefect's temporary API server for one `ftflow` command, where no PREFECT_API_URL is given.

It is the server Prefect starts on its own in that case (SubprocessASGIServer in
prefect.server.api.server): the same uvicorn command and app, the UI and its services off, on a free
local port, stopped when the command ends. It is started here because Prefect's own start imports
that module into this process first (1.9 s of this 2-core CPU, holding the interpreter while the flow
imports), and only then starts the server, which takes 3.4 s more to answer. Started here right after
the input is checked, without that import, it boots on the other core while this process imports the
flow: the command's start to the flow's went 10.5 -> 7.2 s (3-step runs).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prefect.context import refresh_global_settings_context
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    get_current_settings,
)

# The environment Prefect gives its temporary server (SubprocessASGIServer._run_uvicorn_command), over
# the user's settings, and analytics off: Prefect's default sends telemetry, which on a machine without
# internet logged `ERROR | prefect.server.services.telemetry - Failed to send telemetry` in every command.
SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def wait_until_answering(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"Prefect's temporary server at {url} did not answer (exit code {process.poll()})")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def started(port: int) -> subprocess.Popen:
    app_dir = Path(importlib.util.find_spec("prefect").origin).parents[1]
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory"]
        + ["prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
        + ["--log-level", "error", "--lifespan", "on"],
        env=os.environ | get_current_settings().to_environment_variables(exclude_unset=True) | SERVER_ENV,
    )


def temporary_api() -> Callable[[], None]:
    """The server, started now where Prefect would start one (not where an API is given, or the
    temporary server is off), and Prefect's client pointed at it for the rest of this process, as
    Prefect points it at its own; the callable returned waits until it answers. No UI link is
    logged: the server serves none. It stops at the process's exit, after Prefect's exit handlers
    have sent the last logs and events (registered later, they run first), as Prefect's does."""
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return lambda: None
    url, process = f"http://127.0.0.1:{(port := free_port())}/api", started(port)
    atexit.register(stop, process)
    os.environ |= {"PREFECT_API_URL": url, "PREFECT_UI_URL": ""}
    refresh_global_settings_context()  # Prefect's settings, read again from the environment
    return lambda: wait_until_answering(url, process)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
