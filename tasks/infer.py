"""Stage 4: batch inference with Ray Data, one model replica per actor, Parquet out.

Also home of `Predictor`, the one piece of code that turns texts into labels, used by the
inference actors and by evaluation alike.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset
import ray
import torch
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks import cluster, storage
from tasks.data import DataError, expand_inputs, iter_frames

# Written into the output folder after every prediction file, so a reader can tell a complete
# result from the remains of a failed or interrupted job (Parquet readers skip "_" files).
MARKER = "_SUCCESS.json"
PROGRESS_EVERY_S = 10.0


@ray.remote(num_cpus=0)
class Progress:
    """Counts the Ray Data stages report, polled by the driver for the Prefect logs: Ray Data's own
    progress bars go to the driver's terminal, not to the logs a person follows in the UI."""

    def __init__(self) -> None:
        self.files_read, self.rows_read, self.rows_labelled = 0, 0, 0

    def read(self, rows: int) -> None:
        self.files_read += 1
        self.rows_read += rows

    def labelled(self, rows: int) -> None:
        self.rows_labelled += rows

    def counts(self) -> tuple[int, int, int]:
        return self.files_read, self.rows_read, self.rows_labelled


def local_model(model_uri: str) -> str:
    """A local folder holding the model: the path itself, or a download of a remote one."""
    if not storage.is_remote(model_uri):
        return model_uri
    return str(storage.download_dir(model_uri, tempfile.mkdtemp(prefix="ftflow-model-")))


class Predictor:
    """Texts -> (label, score), batching texts of similar length together to cut padding."""

    def __init__(self, model_uri: str, batch_size: int = 64, threads: int | None = None, progress=None):
        folder = local_model(model_uri)
        self.progress = progress
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(self.device).eval()
        self.label_names = [self.model.config.id2label[i] for i in range(self.model.config.num_labels)]
        self.batch_size = batch_size

    @torch.inference_mode()
    def predict(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Label ids and their probabilities, in the order of `texts`."""
        order = np.argsort([len(t) for t in texts], kind="stable")
        ids, scores = np.empty(len(texts), dtype=np.int64), np.empty(len(texts), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            chunk = order[start : start + self.batch_size]
            encoded = self.tokenizer([texts[i] for i in chunk], padding=True, truncation=True, return_tensors="pt")
            probs = self.model(**encoded.to(self.device)).logits.float().softmax(-1)
            best = probs.max(-1)
            ids[chunk], scores[chunk] = best.indices.cpu().numpy(), best.values.cpu().numpy()
        return ids, scores

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        ids, scores = self.predict(batch["text"].tolist())
        if self.progress:
            self.progress.labelled.remote(len(batch))
        return batch.assign(label=[self.label_names[i] for i in ids], score=scores)


def read_rows(text_column: str, id_column: str | None, base: str, progress):
    """A Ray Data UDF: one input file URI in, its rows out as (id, text) frames, streamed."""

    def read(batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        for uri in batch["uri"]:
            name = os.path.relpath(uri, base) if base else Path(uri).name
            seen = 0
            for frame in iter_frames(uri):
                if text_column not in frame.columns or (id_column and id_column not in frame.columns):
                    raise DataError(f"{uri}: column '{text_column if text_column not in frame.columns else id_column}' not found")
                ids = frame[id_column].astype(str) if id_column else [f"{name}:{seen + i}" for i in range(len(frame))]
                yield pd.DataFrame({"id": ids, "text": frame[text_column].astype(str)})
                seen += len(frame)
            progress.read.remote(seen)

    return read


@task
def predict_files(
    model_uri: str,
    input_uri: str,
    output_uri: str,
    text_column: str = "text",
    id_column: str | None = None,
    batch_size: int = 64,
    ray_address: str | None = None,
) -> dict:
    """Label every row of every file under input_uri; Parquet (id, text, label, score) at output_uri,
    complete once output_uri/_SUCCESS.json exists (rows, input and model fingerprints)."""
    files = expand_inputs(input_uri)
    base = os.path.commonpath(files) if len(files) > 1 else ""
    cluster.connect(ray_address)
    actors, cpus, gpus = cluster.Resources.of_cluster().inference_actors()
    clear_output(output_uri)
    out_path, out_fs = storage.pyarrow_filesystem(output_uri)
    logger, progress, started = get_run_logger(), Progress.remote(), time.perf_counter()
    with logging_progress(progress, len(files), logger):
        (
            ray.data.from_items([{"uri": f} for f in files], override_num_blocks=len(files))
            .map_batches(read_rows(text_column, id_column, base, progress), batch_size=1, batch_format="pandas",
                         num_cpus=cluster.READ_CPUS)
            .map_batches(
                Predictor,
                fn_constructor_kwargs={"model_uri": model_uri, "batch_size": batch_size, "threads": max(1, round(cpus)),
                                       "progress": progress},
                batch_size=batch_size * 16,
                batch_format="pandas",
                concurrency=actors,
                num_cpus=cpus,
                num_gpus=gpus,
            )
            .write_parquet(out_path, filesystem=out_fs, ray_remote_args={"num_cpus": cluster.READ_CPUS})
        )
    seconds = time.perf_counter() - started
    rows = pyarrow.dataset.dataset(out_path, filesystem=out_fs, format="parquet").count_rows()
    storage.write_json(storage.join(output_uri, MARKER), {
        "rows": rows,
        "inputs": {uri: storage.fingerprint(uri) for uri in files},
        "model": {"uri": model_uri, "fingerprint": storage.fingerprint(model_uri)},
        "text_column": text_column,
        "id_column": id_column,
    })
    logger.info("labelled %d rows from %d file(s) into %s in %.1f s (%.0f rows/s)", rows, len(files), output_uri,
                seconds, rows / seconds)
    create_table_artifact(
        key="batch-inference-throughput",
        table=[{"rows": rows, "files": len(files), "seconds": round(seconds, 1), "rows_per_s": round(rows / seconds, 1),
                "actors": actors}],
        description=f"{model_uri} over {input_uri}",
    )
    return {"output_uri": output_uri, "rows": rows, "files": len(files)}


@contextmanager
def logging_progress(progress, files: int, logger) -> Iterator[None]:
    """While the pipeline runs, every PROGRESS_EVERY_S: rows labelled, of the rows read so far
    (the total is exact once every file is read), and rows/s."""
    stop, started = threading.Event(), time.perf_counter()

    def report() -> None:
        while not stop.wait(PROGRESS_EVERY_S):
            files_read, rows_read, labelled = ray.get(progress.counts.remote())
            total = f"{rows_read:,}" if files_read == files else f">= {rows_read:,} ({files_read}/{files} files read)"
            logger.info("labelled %s / %s rows, %.0f rows/s", f"{labelled:,}", total, labelled / (time.perf_counter() - started))

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join()


def clear_output(output_uri: str) -> None:
    """A re-run replaces what a previous job left, complete or not, instead of mixing with it; the
    marker goes first, so no reader ever sees it beside a half-deleted output."""
    fs, path = storage.filesystem(output_uri)
    marker = storage.filesystem(storage.join(output_uri, MARKER))[1]
    if fs.exists(marker):
        fs.rm(marker)
    if fs.exists(path):
        fs.rm(path, recursive=True)
