"""A DeepSpeed op build's lock an interrupted build left goes; one a build in progress holds stays."""

from __future__ import annotations

import subprocess
import sys

from tasks.core.ops import CPU_ADAM, interrupted_build_cleared


def test_a_lock_no_process_holds_goes_and_a_held_one_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's JIT cache, as the image sets it
    assert interrupted_build_cleared(CPU_ADAM) is None, "no lock: nothing to do"
    lock = tmp_path / CPU_ADAM / "lock"  # its folder made by the look above, as torch makes it
    lock.touch()
    # A build in progress, in another process: it holds the lock open while it compiles.
    building = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, sys; fd = os.open({str(lock)!r}, os.O_RDONLY); print(1, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert building.stdout.readline() == "1\n"
    assert interrupted_build_cleared(CPU_ADAM) is None and lock.exists()
    building.communicate("")  # the build ends (killed, its lock left behind)
    assert interrupted_build_cleared(CPU_ADAM) == str(lock) and not lock.exists()
