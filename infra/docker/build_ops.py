"""The DeepSpeed ops ftflow's workers can load, made ready in the image for both accelerators it serves
(DeepSpeed picks cuda on a GPU node, cpu elsewhere), then checked with ds_report:
    python infra/docker/build_ops.py                  # exit 1 unless every op is compatible and ready under both
    python infra/docker/build_ops.py CPUAdamBuilder   # elsewhere: JIT-build the named ops for this machine's
                                                      # accelerator, into torch's extensions cache

One op: cpu_adam (DeepSpeedCPUAdam, for train.offload_optimizer). Read in deepspeed 0.19.8: with
torch_adam: true, ZeRO 0-3, bf16/fp16, AutoTP and pipeline stages load none; the other ops its runtime
loads serve NVMe swap, ZeRO++ quantization, native pinning, or the CPU shared-memory collective that
tasks/train/worker.py keeps from building.

DeepSpeed uses an op compiled at install (DS_BUILD_CPU_ADAM=1) only under the accelerator it was
installed for, where ds_report must call it installed. For the other accelerator this script JIT-builds
it into TORCH_EXTENSIONS_DIR, where DeepSpeed's loader finds it, and checks that a new process then
loads it without compiling."""

import os
import re
import subprocess
import sys

from tasks.core.ops import interrupted_build_cleared

OPS = {"cpu_adam": "CPUAdamBuilder"}  # ds_report's name: the builder's class
ACCELERATORS = ("cuda", "cpu")

# Run under one accelerator (DeepSpeed picks one per process): load the op; print its file and whether
# the JIT cache's copy was left as it was.
LOAD = """
import os, sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[1])
cached = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.name, builder.name + ".so")
mtime = lambda: os.path.getmtime(cached) if os.path.exists(cached) else None
before = mtime()
print(builder.load(verbose=False).__file__, before is not None and before == mtime())
"""


def under(accelerator: str, *command: str) -> str:
    done = subprocess.run(command, env=os.environ | {"DS_ACCELERATOR": accelerator}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{command[0]} under {accelerator} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout


def report(accelerator: str) -> dict[str, tuple[bool, bool]]:
    """ds_report's op table under that accelerator: name -> (installed, compatible)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", under(accelerator, "ds_report"))
    rows = re.findall(r"^(\S+)\s+\.*\s*\[(YES|NO)\]\s+\.*\s*\[(OKAY|NO)\]\s*$", text, re.MULTILINE)
    return {name: (installed == "YES", compatible == "OKAY") for name, installed, compatible in rows}


def ready(accelerator: str, name: str, builder: str, installed_for: str, cache: str) -> str | None:
    """None when the op loads under that accelerator without compiling; else why it does not."""
    installed, compatible = report(accelerator).get(name, (False, None))
    if compatible is None:
        return "not in ds_report"
    if not compatible:
        return "not compatible (ds_report)"
    if accelerator == installed_for and not installed:
        return f"not installed (ds_report): the install for {installed_for} did not build it, see its log"
    if not installed:
        under(accelerator, sys.executable, "-c", LOAD, builder)  # the JIT build
    path, unchanged = under(accelerator, sys.executable, "-c", LOAD, builder).split()
    if installed:
        return None if not path.startswith(cache) else f"installed, yet loaded from the JIT cache ({path})"
    return None if path.startswith(cache) and unchanged == "True" else f"compiled again at load ({path})"


def main() -> int:
    if sys.argv[1:]:  # a node or laptop of one accelerator (the hint `ftflow doctor` gives)
        from deepspeed.accelerator import get_accelerator

        for builder in sys.argv[1:]:
            op = get_accelerator().create_op_builder(builder)
            if lock := interrupted_build_cleared(op.name):
                print(f"removed {lock}: an interrupted build's lock, held by no process")
            op.load(verbose=False)
            print(f"built {builder} for {get_accelerator().device_name()}")
        return 0
    cache = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not cache:
        sys.exit("set TORCH_EXTENSIONS_DIR: the cache the workers' DeepSpeed loads JIT-built ops from")
    from deepspeed.git_version_info import accelerator_name  # what the install compiled ops for

    failed = False
    for accelerator in ACCELERATORS:
        for name, builder in OPS.items():
            problem = ready(accelerator, name, builder, accelerator_name, cache)
            how = "installed in the package" if accelerator == accelerator_name else f"prebuilt in {cache}"
            print(f"{accelerator:5} {name}: {problem or 'ready, ' + how}")
            failed |= problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
