"""A training run that says what it is doing: workers' heartbeats (Pulse), a failure said the moment
Ray Train sees it (FailureRelay, on Ray Train's controller), and a stall that explains itself
(Watchdog, on the driver). All three talk over the stage's channel (tasks/core/progress.py). No Prefect:
the first runs in the workers, the second in the controller.

Why: on the first GPU run each worker failure was an INFO line in Ray's own log while the driver
sat in `trainer.fit()` through every attempt, and the console said nothing for minutes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.exceptions import RayActorError
from ray.train import UserCallback
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.context import get_train_context

from tasks.core import storage
from tasks.core.progress import Beat, beat, beats, last_beat, periodically, say
from tasks.core.strict import first_line
from tasks.train import stall

BEAT_EVERY_S = 1.0  # how often a worker's heartbeat is posted, when it changed
# Stall thresholds when train.stall_warning_s is not set: START_S until steps flow, then 20 times
# the recent step time, within [FLOOR_S, START_S]: a checkpoint, an evaluation or a slow read of
# the next Parquet block may take many steps' time without anything being wrong.
START_S, FLOOR_S, STEPS = 300.0, 30.0, 20
TRAINING = "training"
# A stopped group's phase (a failure, a resize), in its workers' last beats: a restart, not a stall. The new
# group's first beat comes after its start and imports, 30 s into a lost node's restart in test_elastic.
RESTARTING = "restarting"
# How long a failed group's nodes are watched for Ray's verdict that one is gone: its GCS marked a node
# SIGKILLed mid-run dead 11-13 s after (bench/lost_node.py).
LOST_NODE_WAIT_S = 60.0


class Resizes(ControllerCallback):
    """On Ray Train's controller: a worker group started at another size than the last (a range of
    num_workers: grown as nodes came, or fewer after a lost node) as one line, with the checkpoint the
    new group resumes from. A Ray Train internal hook: its public callbacks are not told of resizes."""

    def __init__(self, relay: FailureRelay):
        self.relay, self.workers = relay, None

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        workers, was = resize_decision.num_workers, self.workers
        self.workers = workers
        if was is None or workers == was:
            return
        restarting(self.relay.channel)
        change = f"grows from {was} to {workers}" if workers > was else f"goes on with {workers} instead of {was}"
        say(
            self.relay.channel,
            logging.WARNING,
            f"the run {change} training workers, from {self.relay.resumed_from()}",
        )


def restarting(channel: str) -> None:
    """Marks the stopped group's last heartbeats as restarting, for the Watchdog."""
    for heard in beats(channel).values():
        if heard.phase != RESTARTING:
            beat(channel, heard.model_copy(update={"phase": RESTARTING}))


def own(error: BaseException) -> BaseException:
    """The worker's own exception inside Ray Train's wrapper (which carries it with its traceback)."""
    return getattr(error, "_base_exc", error)


class Pulse:
    """A worker's heartbeats: the loop sets its phase and step (a Python assignment: nothing on the
    step's path), and a thread of the worker posts them when they changed, every BEAT_EVERY_S, and
    once more when the block ends, so a failure's line has the step exactly."""

    def __init__(self, channel: str | None, rank: int):
        self.channel, self.rank, self.phase, self.step, self.posted = channel, rank, "starting", 0, None
        self.node_id, self.pid = ray.get_runtime_context().get_node_id(), os.getpid()

    def __call__(self, phase: str, step: int = 0) -> None:
        self.phase, self.step = phase, step

    def post(self) -> None:
        latest = Beat(
            rank=self.rank, phase=self.phase, step=self.step, node_id=self.node_id, pid=self.pid, noticed=self.noticed()
        )
        if latest != self.posted:
            beat(self.channel, latest)
            self.posted = latest

    def noticed(self) -> bool:
        """Whether a preemption notice names this worker's node (Ray Train's watcher tells every worker)."""
        info = get_train_context().preemption_context.preemption_info
        return info is not None and self.node_id in info.preempted_node_ids

    @contextmanager
    def beating(self) -> Iterator[Pulse]:
        if self.channel is None:
            yield self
            return
        self.post()
        with periodically(self.post, BEAT_EVERY_S, last=True):
            yield self


class FailureRelay(UserCallback):
    """On Ray Train's controller: each worker failure as one warning line on the channel, at once,
    naming the worker, its step, the exception and what happens next. Ray Train retries from its
    latest checkpoint, whose step the reports it commits carry (tasks/train/worker.py `save`)."""

    def __init__(self, channel: str, max_failures: int):
        self.channel, self.attempts, self.failures = channel, max_failures + 1, 0
        # Each lost node said once: Ray Train polls a group with a preempted node until its deadline, and a
        # group's heartbeats stay on the channel after it (a later failure's snapshot holds them).
        self.lost_nodes: set[str] = set()
        # None until this controller commits one: a resumed run's latest is from before it started
        self.checkpoint_step: int | None = None

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        if checkpoint is not None and metrics:
            self.checkpoint_step = int(metrics[0]["step"])

    def resumed_from(self) -> str:
        if self.checkpoint_step is not None:
            return f"step {self.checkpoint_step}"
        return "an earlier attempt's latest checkpoint, or step 0 if it left none"

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        preempted = [rank for rank, error in worker_exceptions.items() if self.preempted(rank, error)]
        if not preempted:
            say(self.channel, logging.WARNING, self.failed(*min(worker_exceptions.items())))
            self.watch_for_lost_nodes()
        elif (node := self.node_of(preempted[0])) not in self.lost_nodes:
            self.lost_nodes.add(node)
            say(self.channel, logging.WARNING, self.lost(preempted[0]))
        restarting(self.channel)

    def preempted(self, rank: int, error: Exception) -> bool:
        """Whether the worker died with its node after a preemption notice: Ray's verdict, or ftflow's
        where Ray's misses it. A `ray start` node SIGTERMed drains until its deadline, then stops its raylet;
        the raylet calls its death a preemption only if the deadline has passed by its own clock
        (src/ray/raylet/main.cc), a coin toss at the same millisecond: 2 of 3 runs here were charged to
        max_failures. The flag is set where Ray's failure policy reads it next, after this callback."""
        died = error.health_check_failure if isinstance(error, WorkerHealthCheckFailedError) else error
        if not isinstance(died, RayActorError):
            return False
        last = last_beat(self.channel, rank)
        if not died.preempted and last is not None and last.noticed:
            died._preempted = True
        return died.preempted

    def watch_for_lost_nodes(self) -> None:
        """A node lost without notice fails its peers' collectives before Ray's health check finds its own
        worker gone, so the line above names a survivor's error (gloo's 'Connection reset by peer', in
        every run of bench/lost_node.py), and Ray's GCS says the node is dead seconds later (or before: its
        health checks may be the quicker): the lost node is said then, from a thread of this controller,
        for as long as LOST_NODE_WAIT_S."""
        threading.Thread(target=self.say_lost_nodes, args=(beats(self.channel),), daemon=True).start()

    def say_lost_nodes(self, group: dict[int, Beat]) -> None:
        deadline = time.monotonic() + LOST_NODE_WAIT_S
        while time.monotonic() < deadline:
            gone = dead_nodes() - self.lost_nodes
            lost = [heard for heard in group.values() if heard.node_id in gone]
            self.lost_nodes |= {heard.node_id for heard in lost}
            for heard in lost:
                say(
                    self.channel,
                    logging.WARNING,
                    f"lost training worker {heard.rank}'s node {heard.node_id[:8]} without notice (last heard at "
                    f"step {heard.step}): the cause of the failure above",
                )
            if lost:
                return
            time.sleep(BEAT_EVERY_S)

    def node_of(self, rank: int) -> str:
        last = last_beat(self.channel, rank)
        return last.node_id if last else f"rank {rank}'s"

    def lost(self, rank: int) -> str:
        """A node that went after its preemption notice is not a failure: Ray Train starts the workers
        again from the latest checkpoint, apart from max_failures (tasks/train/preemption.py)."""
        return (
            f"lost training worker {rank}'s node to its preemption{self.at_step(rank)}: "
            f"training goes on from {self.resumed_from()}"
        )

    def failed(self, rank: int, error: Exception) -> str:
        """The failure counted, in one line: the worker, where it was, its exception, what happens next."""
        self.failures += 1
        then = (
            f"retrying from {self.resumed_from()}, attempt {self.failures + 1} of {self.attempts}"
            if self.failures < self.attempts
            else f"no attempt left of {self.attempts}: training fails"
        )
        where, error = self.at_step(rank, phase=True), own(error)
        return f"training worker {rank} failed{where}: {type(error).__name__}: {first_line(error)}; {then}"

    def at_step(self, rank: int, phase: bool = False) -> str:
        """Where the worker was, from its latest heartbeat: ' at step S', with its phase if asked; '' if none came."""
        last = last_beat(self.channel, rank)
        if last is None:
            return ""
        return f" at step {last.step}" + (f" ({last.phase})" if phase else "")


def dead_nodes() -> set[str]:
    """The nodes Ray's GCS has marked dead."""
    return {node["NodeID"] for node in ray.nodes() if not node["Alive"]}


class Watchdog:
    """On the driver, given the workers' latest heartbeats every second: when none has changed for the
    threshold, writes a stall report (tasks/train/stall.py) under the run's stall/<time>/ and logs one
    warning naming the phase and the top stack frame of the worker heard from least recently. Once
    per stall; the run goes on (train.timeout_s still ends it)."""

    def __init__(self, log: logging.Logger, stall_dir: str, stall_warning_s: float | None):
        self.log, self.stall_dir, self.fixed_s = log, stall_dir, stall_warning_s
        self.heard: dict[int, tuple[Beat, float]] = {}  # rank: (its latest beat, when it changed, on this clock)
        self.since, self.step_s, self.reported = time.monotonic(), None, False

    def threshold(self, phase: str | None) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if phase == TRAINING and self.step_s is not None:
            return min(START_S, max(FLOOR_S, STEPS * self.step_s))
        return START_S

    def __call__(self, beats: dict[int, Beat]) -> None:
        now = time.monotonic()
        for rank, latest in beats.items():
            before, at = self.heard.get(rank, (None, self.since))
            if latest == before:
                continue
            if before and before.phase == latest.phase == TRAINING and latest.step > before.step:
                self.step_s = (now - at) / (latest.step - before.step)
            self.heard[rank] = latest, now
        newest = max((at for _, at in self.heard.values()), default=self.since)
        stalest = min(self.heard.values(), key=lambda heard: heard[1], default=(None, self.since))[0]
        silent_s = now - newest
        if silent_s < self.threshold(stalest.phase if stalest else None):
            self.reported = False
            return
        if not self.reported:
            self.reported = True
            self.warn(stalest, silent_s)

    def warn(self, stalest: Beat | None, silent_s: float) -> None:
        folder = storage.join(self.stall_dir, time.strftime("%Y%m%d-%H%M%S"))
        workers = [
            stall.Process(what=f"rank {rank}", node_id=heard.node_id, pid=heard.pid)
            for rank, (heard, _) in sorted(self.heard.items())
        ]
        stuck = next((worker for worker in workers if stalest and worker.pid == stalest.pid), None)
        frame = stall.report(folder, workers, stuck)
        where = (
            f"rank {stalest.rank} is in '{stalest.phase}' at step {stalest.step}"
            if stalest
            else "no training worker has started"
        )
        self.log.warning(
            "training has shown no progress for %.0f s: %s%s; stall report: %s (the run goes on; train.timeout_s ends it)",
            silent_s,
            where,
            f", top frame {frame}" if frame else "",
            folder,
        )
