"""The tests' hooks in every Python process the test session starts, Ray's workers included (conftest
puts this folder first on PYTHONPATH before any Ray starts, and Python imports `sitecustomize` at
start-up): what the tests need inside training workers, so that ftflow's own modules read no test
variable. Nothing is imported here until a hooked module is:

- tasks.train.watch: faults at optimizer steps (conftest.fault_injected writes them), each raised, or
  hung for a while (or until the test writes release-<n> beside them), by one worker, once per run (the
  first worker to reach it, of every attempt; of a group of `workers`, where the fault names them);
- tasks.train.worker: with FTFLOW_TEST_CHECK_DEVICES=1, every collective's tensor checked against
  the worker's training device (tests/hooks/devices.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

FAULT_FILE = "fault.json"  # in FTFLOW_TEST_HOOKS_DIR


def injected(pulse, step: int) -> None:
    """The test's faults, each at its worker and step, if it has not fired yet in this run (the run's
    progress channel names it). A hang leaves hanging-<n>.json beside them as it starts: its step and
    the raylet that started the worker (which node it is on)."""
    hooks = Path(os.environ.get("FTFLOW_TEST_HOOKS_DIR", "/nonexistent"))
    if not (hooks / FAULT_FILE).exists():
        return
    for number, fault in enumerate(json.loads((hooks / FAULT_FILE).read_text())):
        if fault["step"] != step or fault["rank"] != pulse.rank or not in_a_group_of(fault.get("workers")):
            continue
        from ray.experimental import internal_kv

        from tasks.core.progress import NAMESPACE

        if internal_kv._internal_kv_put(f"{pulse.channel}fault{number}", b"1", overwrite=False, namespace=NAMESPACE):
            continue  # True: the key was there, the fault has fired
        if fault["hang_s"]:
            (hooks / f"hanging-{number}.json").write_text(json.dumps({"step": step, "raylet": os.getppid()}))
            hung_until = time.monotonic() + fault["hang_s"]
            while time.monotonic() < hung_until and not (hooks / f"release-{number}").exists():
                time.sleep(0.1)
            continue
        raise RuntimeError(
            f"injected fault at step {step}, at {time.time():.3f}"
        )  # when, for the test to time its line


def in_a_group_of(workers: int | None) -> bool:
    """Whether the worker's group has `workers` (a range of num_workers starts groups of several sizes)."""
    import ray.train

    return workers is None or ray.train.get_context().get_world_size() == workers


def hook_watch(module) -> None:
    beat = module.Pulse.__call__

    def call(self, phase: str, step: int = 0) -> None:
        beat(self, phase, step)
        if phase == module.TRAINING:
            injected(self, step)

    module.Pulse.__call__ = call


def hook_worker(module) -> None:
    if os.environ.get("FTFLOW_TEST_CHECK_DEVICES") != "1":
        return
    train_worker = module.train_worker

    def checked(spec, first_epoch=None) -> str | None:
        import ray.train.torch
        from devices import check_collectives

        check_collectives(ray.train.torch.get_device())
        return train_worker(spec, first_epoch)

    module.train_worker = checked


HOOKS = {"tasks.train.watch": hook_watch, "tasks.train.worker": hook_worker}


class Hooked(importlib.abc.MetaPathFinder):
    """Finds a hooked module as the other finders do, and hooks it once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            HOOKS[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hooked())
