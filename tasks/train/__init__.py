"""Stage 2. task.py: the Prefect tasks; driver.py: the Ray job (Ray Train), with plan.py,
deepspeed_json.py, ingest.py and trainer.py; worker.py: each Ray Train worker's loop, with engine.py,
checkpoints.py, batches.py, stream.py, replica.py and pipeline.py; spec.py: what the driver tells its
workers; strategy.py: strategy=auto; watch.py, stall.py and stall_node.py: heartbeats, failures, stalls.

What the other stages use of training (a sweep's trials train as the stage does; `ftflow doctor` checks
the plan, DeepSpeed JSON, trainer and engine set-up a run would use) is named below and nowhere else.
Each name is imported from its module when first used (PEP 562), not here: the driver side must not
load the workers' transformers and DeepSpeed (4.3 s of a run's start on this CPU), nor a worker the
driver's Ray Train."""

import importlib

INTERFACE = {
    "trained": "driver",  # one training run, on the cluster this process is connected to
    "plan_of": "plan",
    "deepspeed_config": "deepspeed_json",
    "Trainer": "trainer",
    "worker_exception": "trainer",
    "release_placement_groups": "trainer",
    "WorkerSpec": "spec",
    "join_process_group": "engine",
    "param_groups": "engine",
    "precision_of": "engine",
    "resolve_precision": "engine",
}
__all__ = sorted(INTERFACE)


def __getattr__(name: str):
    if name not in INTERFACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{INTERFACE[name]}"), name)
