"""Where a stage's Ray work runs: in this process, joined to the cluster (ftflow's local Ray, or a
driver on the cluster's network), or, from outside the cluster, as a Ray Job on it.

From outside, the stage's driver runs on the head as a Ray Job (the address is the head's Job API,
http://<head>:8265). Ray Client (ray://) is the other way in; Ray's docs warn that it "may not work
as expected" for Ray Train, and tried here (Ray 2.60) Ray Data's executor failed at once through it
(tasks/core/cluster.py `connect` refuses ray:// now, saying so). A job's driver sits beside the cluster, so a
laptop or a Prefect worker moves only the job's arguments, its log lines and its result; a dropped
connection loses the log's tail, not the run.

The wire is one place (this module): the stage's arguments, JSON by its type hints, ride on the job's
command line; its log lines come back on the job's log, and its result (or its error, as one line)
on the log's last line. Written by hand because Ray's Job API returns no value and
Prefect's Ray integration runs tasks through Ray Client.
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import json
import logging
import re
import shlex
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar, get_type_hints

from pydantic import TypeAdapter

from tasks.core import cluster
from tasks.core.progress import TICK, Tick

# Every stage logs here; the lines reach the Prefect run's log from this process or from a job's log.
log = logging.getLogger("ftflow")
JOB_LINE = "ftflow {level} {message}"
RESULT, ERROR, TICK_LINE = "ftflow-result: ", "ftflow-error: ", "ftflow-tick: "
OURS = re.compile(
    "|".join(
        map(re.escape, (RESULT, ERROR, TICK_LINE, *(f"ftflow {level} " for level in logging.getLevelNamesMapping())))
    )
)
Stage = TypeVar("Stage")
# Stages run in this process take turns. Flows side by side in one process (threads) share one Ray
# driver, and on a small cluster one run's inference actors and another's training workers each got
# part of the CPUs they needed and neither all: both waited forever (two runs on a 3-CPU local Ray).
IN_PROCESS = threading.RLock()


def run(
    stage: Callable[..., Stage], address: str | None, logger: logging.Logger | logging.LoggerAdapter, **arguments: Any
) -> Stage:
    """stage(**arguments) on the Ray cluster at `address` (else RAY_ADDRESS, else a local Ray), its
    log lines to `logger`."""
    if api := cluster.jobs_api(address):
        return submitted(stage, api, logger, arguments)
    with IN_PROCESS, forwarded(logger):
        cluster.connect(address)
        try:
            return stage(**arguments)
        except SystemError as error:
            if cancelled := cancellation_in(error):
                raise cancelled from None
            raise


def cancellation_in(error: BaseException) -> asyncio.CancelledError | None:
    """The cancellation a SystemError hides, if it does. Prefect's task timeout raises its
    CancelledError (an asyncio one) from a signal handler. When the signal lands inside a C function
    of Ray's that calls back into Python and ignores the error (`ray.get` did, on an H100), CPython
    reports a SystemError caused by it, which Prefect does not read as its timeout: the run failed
    with "<built-in method __new__ ...> returned a result with an exception set" instead of saying
    that training passed train.timeout_s. Raised again, it becomes Prefect's timeout error."""
    while error is not None and not isinstance(error, asyncio.CancelledError):
        error = error.__cause__ or error.__context__
    return error


@contextmanager
def forwarded(logger: logging.Logger | logging.LoggerAdapter) -> Iterator[None]:
    """The stage's log records to `logger` (a Prefect run logger) for the duration."""

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tick = getattr(record, TICK, None)
            logger.log(record.levelno, record.getMessage(), extra=None if tick is None else {TICK: tick})

    handler, propagate = Forward(), log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # shown once, by the run logger
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def submitted(stage: Callable[..., Stage], address: str, logger, arguments: dict) -> Stage:
    """Run the stage as a Ray Job and follow it: its lines to `logger` as they come, its result back.
    Interrupted (a cancelled flow run, Ctrl-C), the job is stopped with it."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Ray's client says "WebSocket closed for job ..." at every job's end: its news, not the user's.
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    client = JobSubmissionClient(address)
    hints = get_type_hints(stage)
    wire = json.dumps(
        {name: TypeAdapter(hints[name]).dump_python(value, mode="json") for name, value in arguments.items()}
    )
    job = client.submit_job(
        entrypoint=f"python -m tasks.core.jobs {stage.__module__}:{stage.__name__} {shlex.quote(wire)}",
        submission_id=f"ftflow-{stage.__name__}-{uuid.uuid4().hex[:12]}",
    )
    logger.info("%s runs as Ray job %s on %s", stage.__name__, job, address)
    follower = ThreadPoolExecutor(1)  # its own event loop: a Prefect task may run inside one
    try:
        ending = follower.submit(asyncio.run, followed(client, job, logger)).result()
    except BaseException:  # Prefect's cancellation (SIGTERM) arrives as one
        client.stop_job(job)
        raise
    finally:
        follower.shutdown(wait=False)  # the log ends with the job
    status = client.get_job_status(job)
    if status == JobStatus.SUCCEEDED and ending.startswith(RESULT):
        return TypeAdapter(hints["return"]).validate_json(ending.removeprefix(RESULT))
    if ending.startswith(ERROR):
        error = json.loads(ending.removeprefix(ERROR))
        kind = getattr(builtins, error["type"], None)
        raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(error["message"])
    raise RuntimeError(
        f"Ray job {job} on {address} ended {status}: {client.get_job_info(job).message}; "
        f"see `ray job logs {job} --address {address}`"
    )


def ours(line: str) -> str | None:
    """The ftflow line in a line of the job's log, or None. A progress bar of Ray Data's, drawn on
    the same stdout without a newline (cursor moves, spaces), can sit in front of it: seen on a
    3-node cluster, where the result line came after one and the run failed for want of it."""
    found = OURS.search(line)
    return line[found.start() :] if found else None


async def followed(client, job: str, logger) -> str:
    """Forward the job's ftflow lines at their level (Ray's own at debug) until it ends; return its
    last ftflow-result/ftflow-error line, or ''."""
    pending, ending = "", ""
    async for chunk in client.tail_job_logs(job):
        *lines, pending = (pending + chunk).split("\n")
        for line in lines:
            mine = ours(line)
            if mine is None:
                if line.strip():
                    logger.debug(line)
            elif mine.startswith((RESULT, ERROR)):
                ending = mine
            elif mine.startswith(TICK_LINE):
                tick = Tick.model_validate_json(mine.removeprefix(TICK_LINE))
                logger.info(tick.line(), extra={TICK: tick})
            else:
                _, level, message = mine.split(" ", 2)
                logger.log(logging.getLevelName(level), message)
    last = ours(pending)
    return last if last and last.startswith((RESULT, ERROR)) else ending


class JobLines(logging.Formatter):
    """A record as a line of the job's log: a tick whole, as JSON, for followed() to read back."""

    def format(self, record: logging.LogRecord) -> str:
        tick = getattr(record, TICK, None)
        return super().format(record) if tick is None else TICK_LINE + tick.model_dump_json()


def main(target: str, wire: str) -> int:
    """The job's entrypoint, on the cluster: `python -m tasks.core.jobs <module>:<stage> <arguments JSON>`."""
    module, name = target.split(":")
    stage = getattr(importlib.import_module(module), name)
    hints = get_type_hints(stage)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JobLines(JOB_LINE.format(level="%(levelname)s", message="%(message)s")))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        cluster.connect()  # Ray sets RAY_ADDRESS to the cluster for a job's driver
        arguments = {key: TypeAdapter(hints[key]).validate_python(value) for key, value in json.loads(wire).items()}
        result = stage(**arguments)
    except Exception as error:  # noqa: BLE001 -- every failure becomes the one line the caller raises again
        traceback.print_exc()  # the whole story stays in the job's log (`ray job logs`)
        return said(ERROR + json.dumps({"type": type(error).__name__, "message": str(error)}), 1)
    return said(RESULT + TypeAdapter(hints["return"]).dump_json(result).decode(), 0)


def said(line: str, code: int) -> int:
    """The job's last line, written whole (print writes its newline apart, where another thread's
    output could land between them)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
