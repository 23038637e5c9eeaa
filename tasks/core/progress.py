"""Where a stage stands, as it runs: a Tick is logged on the `ftflow` logger with the tick attached
(`log.info(tick.line(), extra={TICK: tick})`), so the same record is a line in the Prefect run's log,
a progress artifact's percentage (tasks/prefect_side/live.py) and a bar in the `ftflow` console (ftflow/console.py),
from this process or from a Ray Job's log (tasks/core/jobs.py carries ticks on the wire).

Ray workers post ticks, lines (say), heartbeats (beat) and running counts (tally) on a channel
(relayed) that the stage's driver drains: Ray Train returns nothing to the driver until it ends, nor
Ray Data until its pipeline has run. tasks/train/watch.py builds training's heartbeats, failure lines and
stall watch on it; tokenization's shard tasks and batch inference's actors tally the rows they
wrote or labelled (tallied). This module imports no Prefect.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pydantic import BaseModel

NAMESPACE = "ftflow-ticks"  # of Ray's key-value store
TICK = "ftflow_tick"  # the log record attribute holding a Tick
STAGE = "ftflow_stage"  # ("start" or "end", the stage): the record marks a flow stage's start or end
RUN_DIR = "ftflow_run_dir"  # the run's folder, once the run has checked it is ftflow's
DRAIN_EVERY_S = 1.0
# How often a driver sums its workers' tallies into a tick: each is a line in the run's log, so not
# every second of a long stage.
REPORT_EVERY_S = 5.0
TICKS, LINES, BEATS, TALLIES = "t/", "l/", "b/", "c/"  # a channel's four kinds of key


class Tick(BaseModel):
    """`done` of `total` units of a stage, with what else it measured (loss, samples/s, ...)."""

    stage: str  # tokenize, train, batch inference: the flow stage it is part of
    done: float
    total: float | None  # None while unknown
    unit: str  # steps, rows
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


class Line(BaseModel):
    """A line a worker or Ray Train's controller has for the run's log (a failure, what an engine is)."""

    level: int
    text: str


class Beat(BaseModel):
    """A worker's heartbeat: what it is doing now (a phase, and the optimizer step it is at)."""

    rank: int
    phase: str  # e.g. "loading the model", "training", "validating"
    step: int = 0
    node_id: str
    pid: int
    noticed: bool = False  # a preemption notice names this worker's node: it is going away


def log_tick(log: logging.Logger, tick: Tick) -> None:
    log.info(tick.line(), extra={TICK: tick})


@contextmanager
def periodically(action: Callable[[], None], every_s: float, last: bool = False) -> Iterator[None]:
    """action() every every_s seconds in a thread of its own while the block runs (and once more
    after it, if last): how a driver follows what its Ray workers report."""
    stop = threading.Event()

    def repeat() -> None:
        while not stop.wait(every_s):
            action()
        if last:
            action()

    thread = threading.Thread(target=repeat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def relayed(log: logging.Logger, watch: Callable[[dict[int, Beat]], None] | None = None) -> Iterator[str]:
    """A channel for Ray workers (and Ray Train's controller) to post ticks, lines and heartbeats on;
    while the block runs, its ticks and lines are logged on `log` in order, and `watch` is given the
    workers' latest heartbeats, every DRAIN_EVERY_S. The channel is a key prefix in Ray's GCS
    key-value store, which every driver and worker already talks to: an actor as the inbox took one of
    the warm Ray worker processes the training workers start in, and the main job's first training
    step came 3 s later (16.8 -> 20.0 s)."""
    channel = f"{uuid.uuid4().hex}/"

    def drain() -> None:
        for key in sorted(kv()._internal_kv_list(channel + TICKS, namespace=NAMESPACE)):
            log_tick(log, Tick.model_validate_json(taken(key)))
        for key in sorted(kv()._internal_kv_list(channel + LINES, namespace=NAMESPACE)):
            line = Line.model_validate_json(taken(key))
            log.log(line.level, line.text)
        if watch is not None:
            watch(beats(channel))

    try:
        with periodically(drain, DRAIN_EVERY_S, last=True):
            yield channel
    finally:
        for key in kv()._internal_kv_list(channel, namespace=NAMESPACE):  # the last beats
            kv()._internal_kv_del(key, namespace=NAMESPACE)


@contextmanager
def tallied(log: logging.Logger, tick_of: Callable[[list[bytes]], Tick], last: bool = False) -> Iterator[str]:
    """A channel for Ray workers to tally their running counts on (tally); while the block runs, every
    REPORT_EVERY_S (and once after it, if last), tick_of(every worker's latest tally) is logged on
    `log`, once a worker has tallied: a line of zeros before any work read like a result. How
    tokenization and batch inference report, as training does, on the key-value store."""

    def report() -> None:  # reads `channel`, opened below before the first report
        if counts := tallies(channel):
            log_tick(log, tick_of(counts))

    with relayed(log) as channel, periodically(report, REPORT_EVERY_S, last=last):
        yield channel


def kv():
    """Ray's own GCS key-value store (Ray Serve and Train use it too), imported when first used: the
    `ftflow` command's console reads this module's records, and refuses bad input, before it needs Ray
    (importing it took 0.4 s of a 1.4 s refusal)."""
    from ray.experimental import internal_kv

    return internal_kv


def taken(key: bytes) -> bytes:
    value = kv()._internal_kv_get(key, namespace=NAMESPACE)
    kv()._internal_kv_del(key, namespace=NAMESPACE)
    return value


def values(prefix: str) -> list[bytes]:
    keys = kv()._internal_kv_list(prefix, namespace=NAMESPACE)
    return [value for key in keys if (value := kv()._internal_kv_get(key, namespace=NAMESPACE)) is not None]


def post(channel: str, tick: Tick) -> None:
    """From a Ray worker: a tick for the driver that opened the channel (keys sort in order of `done`)."""
    kv()._internal_kv_put(f"{channel}{TICKS}{tick.done:015.3f}", tick.model_dump_json(), namespace=NAMESPACE)


def say(channel: str, level: int, text: str) -> None:
    """From a Ray worker or actor: one line for the driver's log, at `level` (keys sort in time order)."""
    line = Line(level=level, text=text)
    kv()._internal_kv_put(
        f"{channel}{LINES}{time.time():017.6f}-{uuid.uuid4().hex[:6]}", line.model_dump_json(), namespace=NAMESPACE
    )


def beat(channel: str, heartbeat: Beat) -> None:
    """From a Ray worker: its latest heartbeat, replacing the one before."""
    kv()._internal_kv_put(f"{channel}{BEATS}{heartbeat.rank:06d}", heartbeat.model_dump_json(), namespace=NAMESPACE)


def tally(channel: str, who: str, counts: BaseModel) -> None:
    """From a Ray worker or actor: its running counts, replacing the ones before."""
    kv()._internal_kv_put(f"{channel}{TALLIES}{who}", counts.model_dump_json(), namespace=NAMESPACE)


def tallies(channel: str) -> list[bytes]:
    """Every worker's latest counts on the channel."""
    return values(channel + TALLIES)


def beats(channel: str) -> dict[int, Beat]:
    """Every worker's latest heartbeat on the channel, by rank."""
    return {beat.rank: beat for beat in map(Beat.model_validate_json, values(channel + BEATS))}


def last_beat(channel: str, rank: int) -> Beat | None:
    value = kv()._internal_kv_get(f"{channel}{BEATS}{rank:06d}", namespace=NAMESPACE)
    return None if value is None else Beat.model_validate_json(value)
