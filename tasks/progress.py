"""Where a stage stands, as it runs: a Tick is logged on the `ftflow` logger with the tick attached
(`log.info(tick.line(), extra={TICK: tick})`), so the same record is a line in the Prefect run's log,
a progress artifact's percentage (tasks/live.py) and a bar in the `ftflow` console (flows/console.py),
from this process or from a Ray Job's log (tasks/jobs.py carries ticks on the wire).

Ray workers report through a Ticks actor that the stage's driver drains: Ray Train and Ray Data
return nothing to the driver until they end. This module imports no Prefect.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from pydantic import BaseModel

TICK = "ftflow_tick"  # the log record attribute holding a Tick
STAGE = "ftflow_stage"  # ("start" or "end", the stage): the record marks a flow stage's start or end
RUN_DIR = "ftflow_run_dir"  # the run's folder, once the run has checked it is ftflow's
DRAIN_EVERY_S = 1.0


class Tick(BaseModel):
    """`done` of `total` units of a stage, with what else it measured (loss, samples/s, ...)."""

    stage: str  # tokenize, train, infer
    done: float
    total: float | None  # None while unknown
    unit: str  # shards, steps, rows
    metrics: dict[str, float] = {}
    text: str = ""  # the line's own words after the counts; default: the metrics

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    def words(self) -> str:
        return self.text or ", ".join(f"{name} {value:.4g}" for name, value in self.metrics.items())

    def line(self) -> str:
        of = f" / {self.total:,.0f}" if self.total is not None else ""
        return f"{self.stage}: {self.done:,.0f}{of} {self.unit}" + (f", {self.words()}" if self.words() else "")


def log_tick(log: logging.Logger, tick: Tick) -> None:
    log.info(tick.line(), extra={TICK: tick})


@ray.remote(num_cpus=0)
class Ticks:
    """Ticks put by Ray workers, taken in order by the driver."""

    def __init__(self) -> None:
        self.pending: list[dict] = []

    def put(self, tick: dict) -> None:
        self.pending.append(tick)

    def take(self) -> list[dict]:
        taken, self.pending = self.pending, []
        return taken


@contextmanager
def relayed(log: logging.Logger) -> Iterator[ray.actor.ActorHandle]:
    """A Ticks actor for workers to put to; while the block runs, its ticks are logged on `log`."""
    ticks, stop = Ticks.remote(), threading.Event()

    def drain() -> None:
        while True:
            stopping = stop.wait(DRAIN_EVERY_S)
            for tick in ray.get(ticks.take.remote()):
                log_tick(log, Tick.model_validate(tick))
            if stopping:
                return

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        yield ticks
    finally:
        stop.set()
        drainer.join()
        ray.kill(ticks)

