"""Stage 4: batch inference with Ray Data, one model replica (tasks/predictor.py) per actor, Parquet out."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyarrow.dataset
import ray
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from ray.data import DataContext
from ray.data.datasource import FilenameProvider

from tasks import cluster, jobs, storage
from tasks.config import InferenceConfig
from tasks.data import DataError, file_format, iter_frames, reading, rows_per_byte, unlabelled_files
from tasks.predictor import Predictor
from tasks.retries import RETRY_TRANSIENT

PROGRESS_EVERY_S = 10.0
WINDOWS_PER_ACTOR = 4  # at least, so that the last, partial window is a small share of any actor's work
# Fewer rows than this (estimated), and unless `actors` says otherwise, one actor takes every CPU:
# a second actor's start (torch, transformers and the model, beside the first's) costs more than
# it labels. all-MiniLM-L6-v2 on 2 cores: 1,066 rows in 10.1-10.9 s with one actor against 15.4 s
# with two; 4,000 rows in 24.4 s against 25.0 s.
ONE_ACTOR_ROWS = 4_000


@ray.remote(num_cpus=0)
class Progress:
    """Counts the Ray Data stages report, polled by the driver for the Prefect logs: Ray Data's own
    progress bars go to the driver's terminal, not to the logs a person follows in the UI."""

    def __init__(self) -> None:
        self.files_read, self.bytes_read, self.rows_read, self.rows_labelled = 0, 0, 0, 0

    def read(self, rows: int, size: int) -> None:
        self.files_read += 1
        self.bytes_read += size
        self.rows_read += rows

    def labelled(self, rows: int) -> None:
        self.rows_labelled += rows

    def counts(self) -> tuple[int, int, int, int]:
        return self.files_read, self.bytes_read, self.rows_read, self.rows_labelled


def read_rows(text_column: str, id_column: str | None, base: str, window_rows: int, progress):
    """A Ray Data UDF: one input file (URI, size) in, its rows out as (id, text) frames of at most
    window_rows rows, streamed: a file of any size is never held whole."""

    def read(batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        for uri, size in zip(batch["uri"], batch["size"]):
            name = os.path.relpath(uri, base) if base else Path(uri).name
            seen = 0
            with reading(uri, file_format(uri)):  # a file may be corrupt past what was checked
                for frame in iter_frames(uri, chunk_rows=window_rows):
                    if text_column not in frame.columns or (id_column and id_column not in frame.columns):
                        raise DataError(f"{uri}: column '{text_column if text_column not in frame.columns else id_column}' not found")
                    ids = frame[id_column].astype(str) if id_column else [f"{name}:{seen + i}" for i in range(len(frame))]
                    yield pd.DataFrame({"id": ids, "text": frame[text_column].astype(str)})
                    seen += len(frame)
            progress.read.remote(seen, size)

    return read


@task(**RETRY_TRANSIENT)
def predict_files(model_uri: str, cfg: InferenceConfig, output_uri: str, ray_address: str | None = None) -> dict:
    """Label every row of every file cfg.input_uri names; Parquet (id, text, label, score) at
    output_uri, complete once output_uri/_SUCCESS.json exists (rows, input and model fingerprints)."""
    checked_inputs(model_uri, cfg, output_uri)  # bad input stops here, before any cluster work
    result = jobs.run(labelled, ray_address, get_run_logger(), model_uri=model_uri, cfg=cfg, output_uri=output_uri)
    create_table_artifact(
        key="batch-inference-throughput",
        table=[{key: result[key] for key in ("rows", "files", "seconds", "rows_per_s", "actors", "window_rows")}],
        description=f"{model_uri} over {result['files']} file(s), labels in {output_uri}",
    )
    return result


def checked_inputs(model_uri: str, cfg: InferenceConfig, output_uri: str) -> list[str]:
    """The input files; refused: none, one that cannot be read or lacks the text or id column, an
    output among the inputs or the model, an output folder holding files ftflow did not write."""
    if cfg.input_uri is None:
        raise ValueError("input_uri: no files to label")
    files = unlabelled_files(cfg.input_uri, cfg.text_column or "text", cfg.id_column)
    storage.refuse_overlap([output_uri], [model_uri, *([cfg.input_uri] if isinstance(cfg.input_uri, str) else cfg.input_uri), *files])
    storage.check_writable(output_uri, "output_uri")
    storage.OutputFolder(output_uri).check()
    return files


def labelled(model_uri: str, cfg: InferenceConfig, output_uri: str) -> dict:
    """The stage's Ray work (tasks/jobs.py runs it where the cluster is): the inputs as the cluster
    sees them, then one Ray Data pipeline, read -> predict -> write."""
    files = checked_inputs(model_uri, cfg, output_uri)
    text_column, id_column, output = cfg.text_column or "text", cfg.id_column, storage.OutputFolder(output_uri)
    base = os.path.commonpath(files) if len(files) > 1 else ""
    sizes = {uri: storage.size(uri) for uri in files}  # once: for the actors, the progress estimate and its reports
    estimate = estimated_rows(sizes)
    resources = cluster.Resources.of_cluster()
    actors, cpus, gpus = resources.inference_actors(cfg.actors or (1 if estimate < ONE_ACTOR_ROWS else None),
                                                    resources.use_gpu(cfg.device))
    job = output.start()  # a re-run replaces exactly what an earlier job here wrote, complete or not
    out_path, out_fs = storage.pyarrow_filesystem(output_uri)
    window = balanced_window(cfg.window_rows, cfg.batch_size, actors, estimate, len(files))
    logger, progress, started = jobs.log, Progress.remote(), time.perf_counter()
    # Ray Data waits for an actor pool's replicas forever unless told otherwise: a pool no node can
    # hold (or that the autoscaler does not add in time) fails instead, below.
    DataContext.get_current().wait_for_min_actors_s = cfg.wait_for_actors_s
    with logging_progress(progress, sizes, logger), refused_pool(actors, cpus, gpus, cfg.wait_for_actors_s):
        (
            ray.data.from_items([{"uri": uri, "size": size} for uri, size in sizes.items()], override_num_blocks=len(files))
            # One reader per actor keeps up with it (reads run at tens of thousands of rows/s) and
            # leaves the CPUs to the model instead of to starting more reader processes.
            .map_batches(read_rows(text_column, id_column, base, window, progress), batch_size=1,
                         batch_format="pandas", num_cpus=cluster.READ_CPUS, concurrency=actors)
            .map_batches(
                Predictor,
                fn_constructor_kwargs={"model_uri": model_uri, "batch_size": cfg.batch_size, "threads": max(1, round(cpus)),
                                       "progress": progress, "precision": cfg.precision},
                batch_size=window,
                batch_format="pandas",
                concurrency=actors,
                num_cpus=cpus,
                num_gpus=gpus,
            )
            # Appends (Ray's default mode): files named by the job, so the folder's record says they are ftflow's.
            .write_parquet(out_path, filesystem=out_fs, filename_provider=FilenameProvider(job, "parquet"),
                           ray_remote_args={"num_cpus": cluster.READ_CPUS})
        )
    seconds = time.perf_counter() - started
    written = output.written(job)
    rows = pyarrow.dataset.dataset([f"{out_path}/{name}" for name in written], filesystem=out_fs, format="parquet").count_rows()
    output.complete(job, written, {
        "rows": rows,
        "inputs": {uri: storage.fingerprint(uri) for uri in files},
        "model": {"uri": model_uri, "fingerprint": storage.fingerprint(model_uri)},
        "text_column": text_column,
        "id_column": id_column,
    })
    logger.info("labelled %d rows from %d file(s) into %s in %.1f s (%.0f rows/s)", rows, len(files), output_uri,
                seconds, rows / seconds)
    return {"output_uri": output_uri, "rows": rows, "files": len(files), "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds, 1), "actors": actors, "window_rows": window}


@contextmanager
def refused_pool(actors: int, cpus: float, gpus: int, wait_s: float) -> Iterator[None]:
    """Ray Data's timeout on starting the actor pool, as one line saying what did not come."""
    try:
        yield
    except ray.exceptions.GetTimeoutError as error:
        if "Timed out while starting actors" not in str(error):
            raise
        raise RuntimeError(f"the Ray cluster did not start {actors} inference actor(s) of {cpus:.2g} CPU{f' and {gpus} GPU' if gpus else ''} "
                           f"each within wait_for_actors_s={wait_s:g}: no node can hold one, or none was added in time; "
                           "see `ray status`") from None


def estimated_rows(sizes: dict[str, int]) -> float:
    """The corpus's rows, from the first file's rows per byte times the corpus's bytes (counting
    them would read the corpus twice)."""
    return rows_per_byte(next(iter(sizes))) * sum(sizes.values())


def balanced_window(window_rows: int, batch_size: int, actors: int, rows: float, files: int) -> int:
    """window_rows, or fewer rows for a small corpus so every actor gets WINDOWS_PER_ACTOR windows
    (10,000 rows in windows of 8,192 made one of two actors label 80% of them), and no more than a
    file's rows on average: Ray Data hands an actor whole blocks (a file's rows, or a window of
    them) until they make a window, so 16 files of 625 rows in windows of 1,254 went out three files
    at a time, six calls for two actors, 5,625 rows to one and 4,375 to the other. Never below a batch."""
    return int(max(batch_size, min(window_rows, rows // (actors * WINDOWS_PER_ACTOR), rows // files)))


@contextmanager
def logging_progress(progress, sizes: dict[str, int], logger) -> Iterator[None]:
    """While the pipeline runs, every PROGRESS_EVERY_S: rows labelled of the total, and rows/s.
    The total is exact once every file is read; before, an estimate from the bytes read so far
    (counting rows up front would read the corpus twice)."""
    stop, started, total_bytes = threading.Event(), time.perf_counter(), sum(sizes.values())

    def report() -> None:
        while not stop.wait(PROGRESS_EVERY_S):
            files_read, bytes_read, rows_read, labelled = ray.get(progress.counts.remote())
            rate = labelled / (time.perf_counter() - started)
            if files_read == len(sizes):
                logger.info("labelled %s / %s rows, %.0f rows/s", f"{labelled:,}", f"{rows_read:,}", rate)
            else:
                estimate = f"~{rows_read * total_bytes / bytes_read:,.0f}" if bytes_read else "?"
                logger.info("labelled %s / %s rows (%d/%d files read), %.0f rows/s", f"{labelled:,}", estimate,
                            files_read, len(sizes), rate)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join()
