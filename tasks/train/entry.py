"""Ray Train's entry point on every worker, by reference: Ray pickles a module's function as its
module and name, so the driver that hands it to Ray Train imports only this file. The worker's code
(tasks/train/worker.py: torch, transformers, DeepSpeed) is imported where it runs; imported by the
driver as well, it took 4.3 s of a `ftflow run`'s start on this 2-core CPU, for a function the
driver never calls. Before those imports the worker starts reading its first epoch's rows
(tasks/train/stream.py), so that Ray Data's processes start beside them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.train.spec import WorkerSpec


def train_worker(spec: WorkerSpec) -> str | None:
    """The driver binds the spec (functools.partial): Ray Train calls it with no argument. Returns why
    training diverged, or None (tasks/train/worker.py `train_worker`)."""
    from tasks.train.stream import first_epoch_started

    first_epoch = first_epoch_started(spec.plan.micro_batch, spec.train)
    # `import deepspeed` imports MLflow where it is installed (its autotuner's optional tracking, which
    # ftflow never runs): 0.43 s of every worker's start on this 2-core CPU. Nothing in a training
    # worker tracks to MLflow (the flow does, tasks/report/tracking.py), so here it reads as absent.
    sys.modules.setdefault("mlflow", None)
    from tasks.train.worker import train_worker as run

    return run(spec, first_epoch)
