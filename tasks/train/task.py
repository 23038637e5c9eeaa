"""Stage 2, the Prefect side: the `train` task and the plan check that runs before tokenization. Their
Ray work is tasks/train/driver.py, run where the cluster is by tasks/core/jobs.py."""

from __future__ import annotations

from prefect import get_run_logger, task

from tasks.contracts.training import Result, TrainingJob
from tasks.core import jobs
from tasks.core.config import ModelConfig
from tasks.core.targets import Targets
from tasks.core.train_config import TrainConfig
from tasks.prefect_side.limits import TRAINING_TAG
from tasks.prefect_side.live import Tracked
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.train.driver import fit
from tasks.train.plan import check_plan


@task(tags=[TRAINING_TAG], **RETRY_TRANSIENT)
def train(job: TrainingJob, ray_address: str | None = None) -> Result:
    """Fine-tune on the tokenized splits; the consolidated model lands in the run's model folder. Returns
    the per-epoch history, the loss and accuracy per step, and the validation predictions."""
    with Tracked("training-progress", "Training: % of its optimizer steps done") as progress:
        return jobs.run(fit, ray_address, progress, job=job)


@task
def check_training_plan(model: ModelConfig, targets: Targets, cfg: TrainConfig, ray_address: str | None = None) -> None:
    """Refuse a plan this cluster cannot run (workers, parallel sizes, device, precision) before the
    run tokenizes: at training's start it came after tokenization (27 s here)."""
    jobs.run(check_plan, ray_address, get_run_logger(), model=model, targets=targets, cfg=cfg)
