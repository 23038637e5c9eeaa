"""Stage 1, the Prefect side: the `tokenize` task, cached by the content key, with one writer per
shard set. Its Ray work is tasks/tokenize/driver.py.

Shards live under a content-addressed prefix and the Prefect cache key is the same content key
(data hashes, how the files are read, tokenizer hash, max length, storage root): renaming or
moving the input files, or a new run id, reuses the shards; any change in what would be computed
recomputes them. The prefix is complete only once layout.MARKER (rows per split) is there,
written last.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import INPUTS
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists

from tasks.contracts.shards import TokenizedSplits
from tasks.core import jobs
from tasks.core.data import Split
from tasks.prefect_side.live import Tracked
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.tokenize.driver import TokenizeKey, tokenized_shards

# How long a run that died holding a shard set's writer slot keeps it: Prefect renews the lease
# while its holder lives, and frees the slot this long after the holder's last renewal.
WRITER_LEASE_S = 60


def one_writer(key: TokenizeKey) -> AbstractContextManager:
    """The right to write key's shard set, one run at a time across every machine that shares this
    Prefect server: a global concurrency limit of 1 named after the content key (made on first use),
    held on a lease. Runs of other content are not held up."""
    name = f"tokenize-{key.digest}"
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    return concurrency(name, occupy=1, strict=True, lease_duration=WRITER_LEASE_S)


@task(cache_policy=INPUTS - "splits" - "model_name_or_path" - "ray_address", persist_result=True, **RETRY_TRANSIENT)
def tokenize(
    key: TokenizeKey, splits: dict[str, Split], model_name_or_path: str, ray_address: str | None = None
) -> TokenizedSplits:
    """Write each split's token ids as Parquet under <root>/tokenized/<key>/; return their URIs. A
    complete set (its marker is there), whoever wrote it, is used as it is and never removed: a run
    may be training on it. Only the writer's slot holder writes, so the leftovers it replaces are an
    interrupted attempt's, never a live one's; a run that waited for the slot finds the set complete."""
    # A set complete already is read without the slot: the server's slot increment and release saved,
    # and, on Prefect 3.8.8's SQLite server, a 503 and its ~2.4 s retry in about half the starts here.
    if key.shards_exist():
        return used(key)
    with one_writer(key):
        if key.shards_exist():  # written while this run waited for the slot
            return used(key)
        with Tracked("tokenization-progress", "Tokenization: % of the shards written") as progress:
            return jobs.run(
                tokenized_shards, ray_address, progress, key=key, splits=splits, model_name_or_path=model_name_or_path
            )


def used(key: TokenizeKey) -> TokenizedSplits:
    get_run_logger().info("using the tokenized shards at %s", key.target)
    return key.shards
