"""DeepSpeed's JIT-built ops (CPU Adam, for train.offload_optimizer): a build an interrupted one left
locked. The training workers and `infra/docker/build_ops.py`: imports no Prefect."""

from __future__ import annotations

import fcntl
import os

import psutil

CPU_ADAM = "cpu_adam"  # DeepSpeed's CPUAdamBuilder's op name: its folder in torch's extensions cache


def interrupted_build_cleared(name: str) -> str | None:
    """torch's JIT build takes the op's folder with a lock file (torch.utils.file_baton) that a killed
    build leaves behind, and every later build then waits on it forever, silently: a `make setup` hung
    35 min on one a killed setup had left, and a run Ctrl-C'd in its first offloaded start would leave
    the next one hung at its engine. The lock goes only when no process has it open (a build holds it
    while it compiles); returns the lock removed. torch's rule for the folder is private
    (`_get_build_directory`): the one DeepSpeed's loader builds in."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, verbose=False)
    lock = os.path.join(folder, "lock")
    if not os.path.exists(lock):
        return None
    # One clearer at a time (a node's workers start together; nodes may share a home folder): between
    # clearers only a build removes a lock, and only the one it holds, so one found unheld stays so.
    folder_fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(folder_fd, fcntl.LOCK_EX)
        if not os.path.exists(lock) or held(lock):
            return None
        os.remove(lock)
        return lock
    finally:
        os.close(folder_fd)  # and with it the flock


def held(path: str) -> bool:
    """Whether a process this user can see has `path` open (another user's builds use their own cache)."""
    for process in psutil.process_iter():
        try:
            if any(opened.path == path for opened in process.open_files()):
                return True
        except psutil.Error:  # another user's, or ended meanwhile
            continue
    return False
