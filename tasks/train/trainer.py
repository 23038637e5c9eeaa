"""Ray Train's TorchTrainer as ftflow runs it: without the placement-group cleaner on the local Ray,
and a failed worker group's error as the worker's own exception."""

from __future__ import annotations

from ray._raylet import PlacementGroupID
from ray.experimental import internal_kv
from ray.train import WorkerGroupError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

from tasks.core import cluster, storage
from tasks.train.watch import own

RUN_NAME = "ray"  # Ray Train's name for a run's folder in its train_dir (RunConfig.name)


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
    ends the whole Ray with its driver, placement groups included; within it, a sweep trial that Ray
    Tune stops takes its controller with it and leaves the workers' placement group reserved (Ray
    scopes it to the job), so the group is noted (PlacementGroupNote) for the sweep to release.
    Ray Train has no option to leave the cleaner out, hence this override of its default callbacks.
    """

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        if not cluster.local_ray():
            return callbacks
        kept = [callback for callback in callbacks if not isinstance(callback, PlacementGroupCleanerCallback)]
        return [*kept, PlacementGroupNote(f"{self.run_config.storage_path}/{self.run_config.name}")]


PLACEMENT_GROUPS = "ftflow-placement-groups"  # the namespace of Ray's key-value store they are noted in


class PlacementGroupNote(WorkerGroupCallback):
    """Notes the placement group of each worker group the controller starts, under the run's storage
    path, in Ray's key-value store (the controller's own process: Ray's internal callback API)."""

    def __init__(self, run: str):
        self.run = run

    def after_worker_group_start(self, worker_group) -> None:
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        internal_kv._internal_kv_put(self.run, group.id.hex(), namespace=PLACEMENT_GROUPS)


def release_placement_group(train_dir: str) -> None:
    """Remove the placement group noted for the training run in train_dir, if it is still there: what
    the cleaner would have done once its controller died."""
    storage_path, _ = storage.pyarrow_filesystem(train_dir)
    noted = internal_kv._internal_kv_get(f"{storage_path}/{RUN_NAME}", namespace=PLACEMENT_GROUPS)
    if noted is None:
        return
    group = PlacementGroup(PlacementGroupID(bytes.fromhex(noted.decode())))
    if placement_group_table(group).get("state") not in (None, "REMOVED"):
        remove_placement_group(group)
