"""A stage's progress in the Prefect UI: a progress artifact of the task run, its percentage moved by
the stage's ticks (tasks/core/progress.py) as they reach the run's log."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.core.progress import TICK


class Tracked(logging.LoggerAdapter):
    """The task run's logger, with a progress artifact that follows the ticks logged through it (from
    any thread: the sync client is asked for, since a Ray Job's log is followed in an event loop),
    and reads 100% once the block it opens ends without an error."""

    def __init__(self, key: str, description: str) -> None:
        super().__init__(get_run_logger())
        self.artifact = create_progress_artifact(0.0, key=key, description=description, _sync=True)
        self.percent = 0.0

    def process(self, msg, kwargs):  # extra as given: the run logger adds the run's own
        return msg, kwargs

    def log(self, level: int, msg, *args, **kwargs) -> None:
        tick = (kwargs.get("extra") or {}).get(TICK)
        if tick is not None and tick.fraction is not None and round(100 * tick.fraction, 1) != self.percent:
            self.percent = round(100 * tick.fraction, 1)
            update_progress_artifact(self.artifact, self.percent, _sync=True)
        super().log(level, msg, *args, **kwargs)

    def __enter__(self) -> Tracked:
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is None and self.percent != 100.0:
            update_progress_artifact(self.artifact, 100.0, _sync=True)
