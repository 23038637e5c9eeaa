"""The sweep's trials, the Prefect side: the task the `sweep` flow runs in place of `train`; its Ray
work is tasks/sweep/driver.py, run where the cluster is by tasks/core/jobs.py."""

from __future__ import annotations

from prefect import task

from tasks.core import jobs
from tasks.core.config import ModelConfig
from tasks.core.layout import RunStore
from tasks.core.sweep_config import SweepConfig
from tasks.core.train_config import TrainConfig
from tasks.prefect_side.limits import TRAINING_TAG
from tasks.prefect_side.live import Tracked
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.sweep.contract import SweepResult
from tasks.sweep.driver import search


@task(tags=[TRAINING_TAG], **RETRY_TRANSIENT)
def sweep_trials(
    tokenized: dict[str, str],
    model: ModelConfig,
    label_names: list[str],
    train: TrainConfig,
    sweep: SweepConfig,
    store: RunStore,
    ray_address: str | None = None,
) -> SweepResult:
    """Train the sweep's trials on the tokenized splits (a retry continues them); the best trial's
    model lands in the sweep's model folder."""
    with Tracked("sweep-progress", "Sweep: % of its trials ended") as progress:
        return jobs.run(
            search,
            ray_address,
            progress,
            tokenized=tokenized,
            model=model,
            label_names=label_names,
            train=train,
            sweep=sweep,
            store=store,
        )
