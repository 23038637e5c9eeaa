"""Ray Train's TorchTrainer as ftflow runs it: without the placement-group cleaner on the local Ray,
its controller noted so that a run can be stopped from outside it, and a failed worker group's error
as the worker's own exception."""

from __future__ import annotations

import json
import os
import signal
import time

import ray
from ray._private import state
from ray._raylet import PlacementGroupID
from ray.core.generated import gcs_pb2
from ray.experimental import internal_kv
from ray.train import WorkerGroupError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.util.placement_group import PlacementGroup, remove_placement_group

from tasks.core import cluster, storage
from tasks.train.watch import own

RUN_NAME = "ray"  # Ray Train's name for a run's folder in its train_dir (RunConfig.name)
CONTROLLERS = "ftflow-train-controllers"  # the namespace of Ray's key-value store they are noted in
CONTROLLER_END_S = 30  # how long a controller whose owner has died may take to die with it
POLL_S = 0.2


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
    scopes it to the job), so the controller is noted (ControllerNote) for the sweep to release its groups.
    Ray Train has no option to leave the cleaner out, hence this override of its default callbacks.
    """

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if isinstance(controller_init_kwargs["scaling_policy"], ElasticScalingPolicy):
            controller_init_kwargs["scaling_policy"] = LeavingDataCpus(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        if cluster.local_ray():
            callbacks = [callback for callback in callbacks if not isinstance(callback, PlacementGroupCleanerCallback)]
        return [*callbacks, ControllerNote(f"{self.run_config.storage_path}/{self.run_config.name}")]


class LeavingDataCpus(ElasticScalingPolicy):
    """Ray Train's elastic policy (a range of num_workers), leaving the CPU ftflow keeps for Ray Data's
    split of the training stream (cluster.DATA_CPUS): Ray's sized a group from every CPU it found, and
    after a lost node the split found none and training waited for its first batch for good (a [1, 2]
    run on three 1-CPU nodes, one SIGKILLed)."""

    def _count_possible_workers(self, reserved_resources) -> int:
        fits = super()._count_possible_workers(reserved_resources)
        per_worker = self.scaling_config._resources_per_worker_not_none.get("CPU", 0)
        if not per_worker:
            return fits
        cpus = sum(node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"])
        return min(fits, int((cpus - cluster.DATA_CPUS) // per_worker))


class ControllerNote(ControllerCallback):
    """Notes the training controller's actor id and process under the run's storage path, in Ray's
    key-value store (in the controller's own process: Ray's internal callback API). Ray Train places
    the controller on the driver's node, so the driver can end that process (stop_controller)."""

    def __init__(self, run: str):
        self.run = run

    def after_controller_start(self, train_run_context) -> None:
        note = {"actor": ray.get_runtime_context().get_actor_id(), "pid": os.getpid()}
        internal_kv._internal_kv_put(self.run, json.dumps(note), namespace=CONTROLLERS)


def noted_controller(train_dir: str) -> dict | None:
    """The run's controller as ControllerNote noted it: its actor id and process id."""
    storage_path, _ = storage.pyarrow_filesystem(train_dir)
    noted = internal_kv._internal_kv_get(f"{storage_path}/{RUN_NAME}", namespace=CONTROLLERS)
    return None if noted is None else json.loads(noted)


def stop_controller(train_dir: str) -> None:
    """End a run's controller from its driver (a timeout, Ctrl-C): its worker actors, which it owns,
    end with it, and the placement group it reserved is released. Ray Train 2.60 offers no abort but
    on SIGINT in the driver's main thread, which Ray's `ray.get` does not let through (see driver.run)."""
    note = noted_controller(train_dir)
    if note is None:
        return
    try:
        os.kill(note["pid"], signal.SIGKILL)
    except ProcessLookupError:  # it had ended
        pass
    release_placement_groups(train_dir)


def release_placement_groups(train_dir: str) -> None:
    """Once the training run's controller (noted by ControllerNote) has died, remove every placement
    group it created that is still there: what the cleaner would have done. By creator, not by the
    group last noted: a worker failure just before a sweep trial was stopped made its controller
    reserve a new group and die before it could say so; the group then held the CPUs the next trial
    waited for, for good."""
    note = noted_controller(train_dir)
    if note is None:
        return
    controller = note["actor"]
    deadline = time.monotonic() + CONTROLLER_END_S
    while state.actors(actor_id=controller).get("State") != "DEAD" and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for group in created_by(controller):
        remove_placement_group(group)


def created_by(actor_id: str) -> list[PlacementGroup]:
    """The placement groups an actor created that Ray has not removed: from the GCS's table, whose
    creator fields the public placement_group_table() leaves out."""
    table = state.state._connect_and_get_accessor().get_placement_group_table()
    groups = [gcs_pb2.PlacementGroupTableData.FromString(raw) for raw in table]
    return [
        PlacementGroup(PlacementGroupID(group.placement_group_id))
        for group in groups
        if group.creator_actor_id.hex() == actor_id and group.state != gcs_pb2.PlacementGroupTableData.REMOVED
    ]
