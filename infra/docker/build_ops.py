"""Compile DeepSpeed ops ahead of time into TORCH_EXTENSIONS_DIR, for the accelerator DS_ACCELERATOR
names: `python infra/docker/build_ops.py CPUAdamBuilder`. DeepSpeed's JIT
loader finds them there at run time instead of compiling again."""

import sys

from deepspeed.accelerator import get_accelerator

for name in sys.argv[1:]:
    get_accelerator().create_op_builder(name).load(verbose=False)
    print(f"built {name} for {get_accelerator().device_name()}")
