"""A sweep trial, in the Ray Tune trial's process: the train stage's training (tasks/train/driver.py)
with the trial's drawn train.* fields, in the trial's folder of the sweep, its every report passed on to
Tune (TuneReportCallback), whose scheduler may stop it. Its warnings reach the sweep's log on the
sweep's channel; its other lines (the plan, the epochs) would be one screen per trial: its table row
says where it is instead."""

from __future__ import annotations

import logging

from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from tasks.contracts.training import TrainingJob
from tasks.core.progress import say
from tasks.core.sweep_config import with_drawn
from tasks.core.train_config import TrainConfig
from tasks.train import trained


class Warnings(logging.Handler):
    """A trial's warnings and errors, as lines of the sweep's log naming the trial."""

    def __init__(self, channel: str, trial_id: str):
        super().__init__(logging.WARNING)
        self.channel, self.trial_id = channel, trial_id

    def emit(self, record: logging.LogRecord) -> None:
        say(self.channel, record.levelno, f"trial {self.trial_id}: {record.getMessage()}")


def trial_logger(channel: str, trial_id: str) -> logging.Logger:
    logger = logging.getLogger(f"ftflow.trial.{trial_id}")
    logger.propagate, logger.handlers = False, [Warnings(channel, trial_id)]
    logger.setLevel(logging.INFO)
    return logger


def run_trial(drawn: dict, job: TrainingJob, channel: str) -> None:
    """Ray Tune's trainable: `drawn` holds the trial's values of the searched fields. A trial run again
    (the sweep re-run, or retried) resumes from its checkpoints, in its folder."""
    trial_id = tune.get_context().get_trial_id()
    cfg = TrainConfig.model_validate(with_drawn(job.train.model_dump(), drawn))
    trial = job.model_copy(update={"train": cfg, "store": job.store.trial(trial_id)})
    trained(trial_logger(channel, trial_id), trial, (TuneReportCallback(),))
