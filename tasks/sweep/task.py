"""The sweep's trials, the Prefect side: the task the `sweep` flow runs in place of `train`; its Ray
work is tasks/sweep/driver.py, run where the cluster is by tasks/core/jobs.py."""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.contracts.sweep import SweepResult, searched
from tasks.contracts.training import TrainingJob
from tasks.core import jobs, storage
from tasks.core.layout import RunStore
from tasks.core.sweep_config import SweepConfig, SweepParams
from tasks.prefect_side.limits import TRAINING_TAG
from tasks.prefect_side.live import Tracked
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.sweep.driver import search


@task(tags=[TRAINING_TAG], **RETRY_TRANSIENT)
def sweep_trials(job: TrainingJob, sweep: SweepConfig, ray_address: str | None = None) -> SweepResult:
    """Train the sweep's trials of the job (a retry continues them); the best trial's model lands in the
    sweep's model folder."""
    with Tracked("sweep-progress", "Sweep: % of its trials ended") as progress:
        return jobs.run(search, ray_address, progress, job=job, sweep=sweep)


def same_search(params: SweepParams, store: RunStore) -> None:
    """A sweep's id stands for one search: its sweep.* and train.* fields, written when its trials
    first start (tasks/sweep/driver.py). A re-run with the same id and another search is refused,
    naming the first field that changed: Ray Tune would restore the first search's trials and say
    nothing of the new one."""
    if not storage.exists(store.search):
        return
    if changed := first_change(storage.read_json(store.search), searched(params.sweep, params.train)):
        field, held, given = changed
        raise ValueError(
            f"{field}: {given!r}, but sweep {store.run_id} started with {held!r}: a sweep's id continues the "
            "search it started; give the same search, or another run_id"
        )


def first_change(held: Any, given: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first dotted field whose value differs between two parameter trees, with both values."""
    if isinstance(held, dict) and isinstance(given, dict):
        for key in list(held) + [key for key in given if key not in held]:
            if changed := first_change(held.get(key), given.get(key), f"{path}.{key}" if path else key):
                return changed
        return None
    return None if held == given else (path, held, given)
