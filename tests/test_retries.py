"""What a task retries: a transient failure anywhere in the chain of causes; never bad input, a bug,
a task's own timeout, or training that Ray Train already restarted max_failures times."""

from __future__ import annotations

import pytest
from botocore.exceptions import EndpointConnectionError
from prefect.task_engine import TaskRunTimeoutError
from ray.exceptions import GetTimeoutError
from ray.train.v2.api.exceptions import WorkerGroupError

from tasks.core.data import DataError
from tasks.prefect_side.retries import transient


def caused_by(cause: BaseException, error: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def raised_from_none(handled: BaseException, error: BaseException) -> BaseException:
    """`raise error from None` while handling `handled`."""
    error.__context__, error.__suppress_context__ = handled, True
    return error


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError(104, "Connection reset by peer"),
        caused_by(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), RuntimeError("reading shards failed")),
        OSError(
            5, "An error occurred (SlowDown) when calling the PutObject operation: Please reduce your request rate."
        ),
        caused_by(
            OSError(5, "An error occurred (InternalError) when calling the GetObject operation"), ValueError("x")
        ),
        ConnectionError("could not reach the Ray Job API at http://head:8265"),
    ],
)
def test_a_transient_failure_is_retried(error):
    assert transient(error)


@pytest.mark.parametrize(
    "error",
    [
        DataError("corpus/a.jsonl: column 'text' not found"),
        FileNotFoundError(2, "No such file or directory", "corpus/500.jsonl"),
        TaskRunTimeoutError("Scope timed out after 10 second(s)."),
        caused_by(ConnectionResetError(), WorkerGroupError("training failed", {})),
        raised_from_none(
            GetTimeoutError("Timed out while starting actors."),
            RuntimeError("the Ray cluster did not start 1 inference actor(s) ... within wait_for_actors_s=10"),
        ),
        RuntimeError("a bug"),
        None,
    ],
)
def test_anything_else_fails_at_once(error):
    assert not transient(error)
