"""Retries for the Prefect tasks that touch storage or Ray: a transient failure (a connection
dropped or refused, a store's 5xx or throttling that outlasted boto's own retries, a Ray node or
object lost) is tried again with exponential backoff; anything else (a refusal of bad input, a bug,
a task's timeout, training that failed more often than train.max_failures allows) fails at once.

Each stage is safe to run again: tokenization reuses a complete shard set, training resumes from its
last checkpoint, an output folder takes over its own earlier job's files, promotion compares again.
Prefect's retry_condition_fn decides; what counts as transient is ftflow's to say.
"""

from __future__ import annotations

import builtins

from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError
from prefect.task_engine import TaskRunTimeoutError
from prefect.tasks import exponential_backoff
from ray.exceptions import NodeDiedError, ObjectLostError, OwnerDiedError, RaySystemError
from ray.train.v2.api.exceptions import TrainingFailedError

# In the exception or its causes: builtins.ConnectionError covers resets, refusals and broken pipes
# (and Ray Job submission to an unreachable head); TimeoutError a socket's timeout.
TRANSIENT = (
    builtins.ConnectionError,
    TimeoutError,
    BotoConnectionError,
    HTTPClientError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    RaySystemError,
)
# Words of a store's 5xx or throttling, as s3fs re-raises them (an OSError naming the code).
TRANSIENT_WORDS = (
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "InternalServerError",
    "RequestTimeout",
    "Throttl",
)


def transient(error: BaseException | None) -> bool:
    """Whether error, or what caused it, is worth trying again."""
    # Not a task's own timeout (a TimeoutError too), nor Ray Train's verdict after its own
    # max_failures restarts.
    if error is None or isinstance(error, (TaskRunTimeoutError, TrainingFailedError)):
        return False
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, TRANSIENT) or (
            isinstance(error, OSError) and any(w in str(error) for w in TRANSIENT_WORDS)
        ):
            return True
        # `raise ... from None` says the error being handled is not the cause: the wait for inference
        # actors, raised so over Ray's GetTimeoutError (a TimeoutError), was tried 4 times, and a
        # wait_for_actors_s of 10 s took 70 s to fail.
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


def _retry_if_transient(task, task_run, state) -> bool:
    return transient(state.result(raise_on_failure=False))


# Four tries in about 1 + 2 + 4 s (x 0.5-1.5 jitter): longer than a store's throttling burst or a
# connection reset, short beside a stage.
RETRY_TRANSIENT = dict(
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=1),
    retry_jitter_factor=0.5,
    retry_condition_fn=_retry_if_transient,
)
