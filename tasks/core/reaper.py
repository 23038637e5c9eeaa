"""Nothing a driver started outlives it, even when it is SIGKILLed.

A flow run on a laptop starts Prefect's temporary API server and a local Ray (GCS, raylet, agents,
workers). Killed hard, the driver runs no exit handler: Prefect's server lived on for good, and
Ray's agents and workers for minutes. Neither library offers a way to bind them to the driver (Ray
binds only its own GCS and raylet, with PR_SET_PDEATHSIG), so a small watcher does: it notes the
driver's descendants that are Ray's or Prefect's server every half second, and when the driver is
gone (its pipe closes) it stops the ones it saw: Ray's with SIGKILL, Prefect's server with SIGTERM
then SIGKILL. Any other process the driver started (a notebook's own) is left alone, and a process is
recognised by its pid and start time, so a pid the system reused is never touched.
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys

import psutil

POLL_S = 0.5  # how often the watcher lists the driver's descendants
# Command lines of the processes reaped: Ray's (binaries and scripts in its package, workers named
# ray::<task>) and Prefect's temporary server.
PREFECT_SERVER = "prefect.server"
REAPED = (importlib.util.find_spec("ray").submodule_search_locations[0], "ray::", PREFECT_SERVER)
GRACE_S = 5.0  # Prefect's server: from SIGTERM to SIGKILL


_watched: list[int] = []  # this process's pid, once its watcher runs


def reap_on_exit() -> None:
    """Start the watcher for this process (once): from then on, whatever it starts ends with it."""
    if _watched == [os.getpid()]:
        return
    _watched[:] = [os.getpid()]
    read_end, write_end = os.pipe()  # neither end is inherited by what this process starts later
    subprocess.Popen(
        [sys.executable, "-m", "tasks.core.reaper", str(os.getpid()), str(read_end)],
        pass_fds=[read_end],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read_end)  # the write end stays open in this process alone: it closes when the process ends


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # killed, not yet waited for by its parent
    except psutil.NoSuchProcess:
        return True


def mark(process: psutil.Process) -> str | None:
    """Which of REAPED the process's command line holds, if any."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:  # ended, or not ours to read
        return None
    return next((mark for mark in REAPED if mark in command), None)


def watch(driver_pid: int, pipe: int) -> None:
    """The watcher: until the driver is gone, note its descendants; then stop those still running.
    Prefect's server is asked to stop (its database closed cleanly), and killed after GRACE_S; Ray's
    processes are killed at once: their raylet and GCS died with the driver, and SIGTERMed, every one
    of them waited out the grace (a killed `ftflow run`: 7 agents and actors, 5 s)."""
    driver, seen = psutil.Process(driver_pid), {}  # process (pid and start time) -> its mark, or None
    while not select.select([pipe], [], [], POLL_S)[0] and not gone(driver):
        try:
            # an unmarked one read again: caught between its fork and its exec, it showed its parent's command
            seen.update({p: mark(p) for p in driver.children(recursive=True) if not seen.get(p)})
        except psutil.NoSuchProcess:
            break
    survivors = [p for p, marked in seen.items() if marked and p.is_running()]  # is_running() compares start times too
    for process in survivors:
        try:
            process.terminate() if seen[process] == PREFECT_SERVER else process.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(survivors, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
