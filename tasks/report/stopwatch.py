"""A flow's clock: wall seconds per stage, and its fixed costs around training, phase by phase."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from tasks.contracts.training import Marks
from tasks.core.progress import STAGE


class Stopwatch:
    """Wall seconds per stage of a flow, and its fixed costs around training, phase by phase. Prefect
    records task-run times too, but its API holds them only once its event pipeline has caught up, so a
    report reading them at the end would race it. Each stage's start and end are logged, marked for the
    console."""

    process_started: float | None = psutil.Process().create_time()  # for the first flow a process runs only

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.logger, self.started, self.points, self.seconds = logger, time.time(), {}, {}
        # A command's or a deployment run's process starts for its flow; a notebook's or a server's
        # runs others before, and its start says nothing of this one.
        self.process_started, Stopwatch.process_started = Stopwatch.process_started, None

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.logger.info("%s", stage, extra={STAGE: ("start", stage)})
        self.points[f"{stage} began"] = started = time.time()
        yield
        self.points[f"{stage} ended"] = time.time()
        self.seconds[stage] = round(self.points[f"{stage} ended"] - started, 2)
        self.logger.info("%s: %.1f s", stage, self.seconds[stage], extra={STAGE: ("end", stage)})

    def mark(self, point: str) -> None:
        self.points[point] = time.time()

    def fixed_costs(self, training: Marks | None) -> None:
        """From the flow's start to training's first step and from training's end to now (the report),
        and "phases": every second of the process, from its start to now, as the gaps between the points
        the flow and training's rank 0 reached (the workers' clock: NTP keeps nodes within milliseconds)."""
        marks = training or Marks(started=self.points["train began"])
        now = time.time()
        if marks.first_step:  # a re-run of a finished run takes no step
            self.seconds["start to first training step"] = round(marks.first_step - self.started, 2)
        self.seconds["training's end to the report"] = round(now - self.points["train ended"], 2)
        points = [
            ("imports and Prefect's start", self.process_started),
            ("checks and Ray's start", self.started),
            ("tokenize", self.points["cluster ready"]),
            ("Ray Train's worker processes", self.points["train began"]),
            ("process group, model and engine", marks.started),
            ("first batch from the data pipeline", marks.engine_built),
            ("first micro-batch", marks.first_batch),
            ("training steps", marks.first_step),
            ("last validation, checkpoint, test labels", marks.last_step),
            ("export and Ray Train's end", marks.test_labelled),
            ("evaluate, promote, batch inference, report", self.points["train ended"]),
            ("end", now),
        ]
        reached = [(phase, at) for phase, at in points if at]
        self.seconds["phases"] = {
            phase: round(end - start, 2) for (phase, start), (_, end) in itertools.pairwise(reached)
        }
