"""Stage 4, the driver side (a Ray job on the cluster, no Prefect): batch inference with Ray Data,
model actors (tasks/infer/worker.py) labelling the input files a part at a time, Parquet out."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import ray
from ray.data import DataContext

from tasks.contracts.labels import Labelled
from tasks.core import cluster, jobs, layout, storage
from tasks.core.config import InferenceConfig
from tasks.core.files import cut, expand_inputs, numbered, rows_per_byte
from tasks.core.progress import Tick, log_tick, tallied
from tasks.infer.labels import completed, file_names
from tasks.infer.worker import Counts, Labeller, Part

PARTS_PER_ACTOR = 4  # at least, so that the last part to finish is a small share of any actor's work
PART_BYTES = 64 << 20  # the most of a file one actor call labels: what a retried call redoes
# Fewer rows than this (estimated), and unless `actors` says otherwise, one actor takes every CPU:
# a second actor's start (torch, transformers and the model, beside the first's) costs more than
# it labels. all-MiniLM-L6-v2 on 2 cores: 1,066 rows in 10.1-10.9 s with one actor against 15.4 s
# with two; 4,000 rows in 24.4 s against 25.0 s.
ONE_ACTOR_ROWS = 4_000


def labelled(model_uri: str, cfg: InferenceConfig, output_uri: str) -> Labelled:
    """The stage's Ray work (tasks/core/jobs.py runs it where the cluster is): the files as the cluster
    sees them, cut into parts, then one Ray Data pipeline of model actors, each labelling a part per
    call (tasks/infer/worker.py)."""
    files = expand_inputs(cfg.input_uri)
    output = layout.OutputFolder(output_uri)
    sizes = {uri: storage.size(uri) for uri in files}  # once: for the actors and the parts
    actors, cpus, gpus = actor_pool(cfg, sizes)
    parts = cut_in_parts(sizes, actors, cfg.format)
    job = output.start()  # a re-run replaces exactly what an earlier job here wrote, complete or not
    started = time.perf_counter()
    # Ray Data waits for an actor pool's replicas forever unless told otherwise: a pool no node can
    # hold (or that the autoscaler does not add in time) fails instead, below.
    DataContext.get_current().wait_for_min_actors_s = cfg.wait_for_actors_s
    with logging_progress(parts, jobs.log) as channel:
        labeller = {
            "model_uri": model_uri,
            "output": storage.pyarrow_filesystem(output_uri),
            "job": job,
            "cfg": cfg,
            "threads": max(1, round(cpus)),
            "channel": channel,
        }
        label_all(parts, labeller, actors, cpus, gpus, cfg.wait_for_actors_s)
    seconds = time.perf_counter() - started
    rows = completed(output, job, files, model_uri, cfg.model_copy(update={"text_column": cfg.text_column or "text"}))
    return said(
        Labelled(
            output_uri=output_uri,
            rows=rows,
            files=len(files),
            seconds=round(seconds, 2),
            rows_per_s=round(rows / seconds, 1),
            actors=actors,
            parts=len(parts),
        )
    )


def actor_pool(cfg: InferenceConfig, sizes: dict[str, int]) -> tuple[int, float, float]:
    """The labelling actors (one for a small job) and each one's CPUs and GPUs, on this cluster."""
    resources = cluster.Resources.of_cluster()
    actors, cpus, gpus = resources.inference_actors(
        cfg.actors or (1 if estimated_rows(sizes, cfg.format) < ONE_ACTOR_ROWS else None), resources.use_gpu(cfg.device)
    )
    if cfg.engine == "deepspeed" and not gpus:
        raise ValueError(
            "inference.engine=deepspeed runs DeepSpeed's CUDA kernels, and this job labels on CPUs (the Ray "
            "cluster has no GPU now): use torch or compile, or device=gpu"
        )
    return actors, cpus, gpus


def said(result: Labelled) -> Labelled:
    """The job's last tick and line."""
    rate = result.rows_per_s
    tick = Tick(
        stage="batch inference",
        done=result.rows,
        total=result.rows,
        unit="rows",
        metrics={"rows_per_s": rate},
        text=f"{rate:,.0f} rows/s",
    )
    log_tick(jobs.log, tick)
    jobs.log.info(
        "labelled %d rows from %d file(s) into %s in %.1f s (%.0f rows/s)",
        result.rows,
        result.files,
        result.output_uri,
        result.seconds,
        rate,
    )
    return result


def cut_in_parts(sizes: dict[str, int], actors: int, fmt: str = "auto") -> list[Part]:
    """The files as parts of at most an actor's share of the corpus over PARTS_PER_ACTOR (and at
    most PART_BYTES): whole files, or pieces of larger ones, each with its first row in the file for
    the default row ids. For two actors, 16 files of 625 rows are 16 parts, and one file of 10,000
    rows is 8: the actors share the work evenly however it is laid out in files."""
    share = sum(sizes.values()) / (actors * PARTS_PER_ACTOR) if actors > 1 else PART_BYTES
    parts = []
    for uri, name in file_names(list(sizes)).items():
        for piece in numbered(cut(uri, fmt, piece_bytes=max(1, int(min(share, PART_BYTES)))), fmt):
            parts.append(Part(uri, piece.start, piece.stop, piece.size, piece.file_row, name, len(parts)))
    return parts


def label_all(parts: list[Part], labeller: dict, actors: int, cpus: float, gpus: int, wait_s: float) -> None:
    """The parts through one Ray Data pipeline of `actors` Labellers. When it fails, its actors are
    gone by the time this raises, and the error carries no frames.

    Ray Data drops a failed pipeline's actors rather than killing them, and its executor keeps the
    handles of tasks still in flight in reference cycles that only a full garbage collection frees.
    An error that kept Ray Data's frames (as its traceback, or as the error it was raised while
    handling; Prefect keeps a failed run's error) kept them for good. Seen in the suite: a failed
    job's actor held its 2 CPUs for 61 s, and a timed-out pool's for 20 min, while the next jobs
    waited for them. Hence the error stripped and raised outside the `except`, after a collection.
    A @contextmanager can't do it: its re-raise restores the error's traceback."""
    try:
        ray.data.from_items([asdict(part) for part in parts], override_num_blocks=len(parts)).map_batches(
            Labeller,
            fn_constructor_kwargs=labeller,
            batch_size=1,  # a part per call
            batch_format="pandas",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=cpus,
            num_gpus=gpus,
        ).materialize()
        return
    except ray.exceptions.GetTimeoutError as error:
        failure = (
            pool_not_started(actors, cpus, gpus, wait_s) if "Timed out while starting actors" in str(error) else error
        )
    except BaseException as error:  # noqa: BLE001 -- raised below; a cancellation (timeout_s) leaves actors too
        failure = error
    failure = without_frames(failure)
    gc.collect()
    raise failure


def pool_not_started(actors: int, cpus: float, gpus: int, wait_s: float) -> RuntimeError:
    """Ray Data's timeout on starting the actor pool, as what did not come."""
    return RuntimeError(
        f"the Ray cluster did not start {actors} inference actor(s) of {cpus:.2g} CPU{f' and {gpus} GPU' if gpus else ''} "
        f"each within wait_for_actors_s={wait_s:g}: no node can hold one, or none was added in time; "
        "see `ray status`"
    )


def without_frames(error: BaseException) -> BaseException:
    """The error, and each one in its chain, with no traceback, and no context (the error that was
    being handled when it was raised): only their words travel on."""
    error.__context__, link, seen = None, error, set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error


def estimated_rows(sizes: dict[str, int], fmt: str = "auto") -> float:
    """The corpus's rows, from the first file's rows per byte times the corpus's bytes (counting
    them would read the corpus twice)."""
    return rows_per_byte(next(iter(sizes)), fmt) * sum(sizes.values())


def progress_tick(counts: list[Counts], parts: int, total_bytes: int, seconds: float) -> Tick:
    """Rows labelled of the total, and rows/s, from the actors' counts. The total is exact once every
    part is done; before, an estimate from the bytes done so far (counting rows up front would read
    the corpus twice), unknown until a part is done."""
    parts_done, bytes_done, rows_done, labelled = (sum(getattr(c, n) for c in counts) for n in Counts.model_fields)
    rate = labelled / seconds
    total = rows_done if parts_done == parts else rows_done * total_bytes / bytes_done if bytes_done else None
    estimated = "" if parts_done == parts else f" (total estimated; {parts_done}/{parts} parts done)"
    return Tick(
        stage="batch inference",
        done=labelled,
        total=total,
        unit="rows",
        metrics={"rows_per_s": rate},
        text=f"{rate:,.0f} rows/s{estimated}",
    )


@contextmanager
def logging_progress(parts: list[Part], logger) -> Iterator[str]:
    """A channel (tasks/core/progress.py) for the pipeline's actors to tally their counts on, and while
    the pipeline runs, every REPORT_EVERY_S once an actor has labelled a window, its progress_tick. Ray
    Data's own progress bars go to the driver's terminal, not to the logs a person follows in the UI."""
    started, total_bytes = time.perf_counter(), sum(part.size for part in parts)

    def tick_of(tallies: list[bytes]) -> Tick:
        counts = [Counts.model_validate_json(value) for value in tallies]
        return progress_tick(counts, len(parts), total_bytes, time.perf_counter() - started)

    with tallied(logger, tick_of) as channel:
        yield channel
