"""Ray Train's TorchTrainer as ftflow runs it: without the placement-group cleaner on the local Ray,
and a failed worker group's error as the worker's own exception."""

from __future__ import annotations

import ray
from ray.train import WorkerGroupError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from tasks.train.watch import own


def worker_exception(error: WorkerGroupError) -> BaseException:
    """The lowest failed rank's own exception, its traceback (from the worker) kept as a note."""
    rank, failure = min(error.worker_failures.items())
    exception = own(failure)
    exception.add_note(f"raised by training worker {rank}" + (f":\n{failure}" if failure is not exception else ""))
    return exception


class Trainer(TorchTrainer):
    """Ray Train's TorchTrainer, without its placement-group cleaner on a cluster with no dashboard (the
    local Ray ftflow starts).

    The cleaner (Ray 2.60) asks the dashboard's state API every second whether the training controller
    lives, to remove its placement group if it died. With no dashboard it can never know: each ask
    searched this machine's Ray processes for 40 s, and its stop at the end of every fit() waited out
    its 12 s timeout (bench/local_fit.py). On the local Ray, ftflow's reaper (tasks/core/reaper.py)
    ends the whole Ray with its driver, placement groups included. Ray Train has no option to leave
    the cleaner out, hence this override of its default callbacks.
    """

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        if not local_ray():
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, PlacementGroupCleanerCallback)]


def local_ray() -> bool:
    """The local Ray ftflow starts (tasks/core/cluster.py), known by its lack of a dashboard: one
    machine, no node to lose to a preemption, and a reaper that ends it with its driver."""
    return not ray._private.worker.get_dashboard_url()
