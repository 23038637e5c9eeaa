"""A check the tests turn on in every training worker (FTFLOW_TEST_CHECK_DEVICES=1, through
tests/hooks/sitecustomize.py): each tensor a
torch.distributed collective is given must live on the device the worker trains on. NCCL takes CUDA
tensors only, so on a GPU a host tensor in an all-reduce fails the run; on a CPU, where the tests run,
the worker's device *is* the host, and the same mistake passes unseen. So the check also refuses a
tensor that ftflow's own code made without naming a device (`torch.tensor([...])`): on a GPU that is
the host tensor NCCL refuses. The first GPU run failed every epoch's end on exactly that.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

OURS = str(Path(__file__).resolve().parents[2] / "tasks")  # the code that runs in the workers
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "broadcast",
    "all_to_all_single",
    "gather",
    "scatter",
)


class HostDefaults(TorchFunctionMode):
    """Remembers the tensors made by a factory call in ftflow's code that names no device."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, weakref.ref] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES and "device" not in kwargs and sys._getframe(1).f_code.co_filename.startswith(OURS):
            self.made[id(result)] = weakref.ref(result)
        return result

    def holds(self, tensor: torch.Tensor) -> bool:
        made = self.made.get(id(tensor))
        return made is not None and made() is tensor


def on_a_host_group(group) -> bool:
    """A gloo group of ftflow's own beside the training one (tasks/train/preemption.py): host tensors
    are what it takes, on a GPU too."""
    return group is not None and group is not dist.GroupMember.WORLD and dist.get_backend(group) == "gloo"


def check_collectives(device: torch.device) -> None:
    """From here on in this worker's thread, a collective refuses a tensor off `device`, or one that
    ftflow's code made on the default device, naming the collective and the tensor's shape."""
    defaults = HostDefaults()
    defaults.__enter__()  # for the rest of the training function: modes are per thread

    def checked(name: str, collective):
        def call(*args, **kwargs):
            if on_a_host_group(kwargs.get("group")):
                return collective(*args, **kwargs)
            for tensor in [*args, *kwargs.values()]:
                tensors = tensor if isinstance(tensor, list | tuple) else [tensor]
                for each in (t for t in tensors if isinstance(t, torch.Tensor)):
                    if each.device != device or defaults.holds(each):
                        where = "made without a device" if each.device == device else f"on {each.device}"
                        raise RuntimeError(
                            f"torch.distributed.{name} got a {tuple(each.shape)} tensor {where}, and the worker trains on "
                            f"{device}: NCCL would refuse it"
                        )
            return collective(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, checked(name, getattr(dist, name)))
