"""What batch inference writes, in one place (its schema: tasks/contracts/labels.py): a window of labels as a table,
the default row ids, and the output folder's record. Also the test split's labels written from the
labels the trained engine gave it (tasks/train/worker.py), exactly as a model's actors would write
them: the finetune flow's batch inference of the test split then loads no model again (9.8 s of a
20-step main job on this CPU, for rows evaluation had just labelled). Imports no torch and no Ray."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq

from tasks.contracts.labels import Labelled, Reading, labels_schema
from tasks.contracts.training import Predictions
from tasks.core import layout, storage
from tasks.core.config import InferenceConfig
from tasks.core.data import Split
from tasks.core.files import iter_frames
from tasks.core.tagging import Tagged
from tasks.core.targets import Targets


def file_names(files: list[str]) -> dict[str, str]:
    """Each file's name in the default row ids '<name>:<row in the file>': its path below the files'
    common folder (its own name when it is the only one)."""
    base = os.path.commonpath(files) if len(files) > 1 else ""
    return {uri: os.path.relpath(uri, base) if base else Path(uri).name for uri in files}


def columns(targets: Targets, thresholds: list[float], outputs: np.ndarray) -> dict[str, list | np.ndarray]:
    """A window's predictions (Predictor.outputs: rows x outputs) as the columns labels_schema names."""
    names = np.asarray(targets.names)
    if targets.task == "single_label":
        return {"label": names[outputs.argmax(1)], "score": outputs.max(1)}
    if targets.task == "multi_label":
        given = outputs >= np.asarray(thresholds)
        return {"labels": [names[row].tolist() for row in given], "scores": list(outputs)}
    return {name: outputs[:, i] for i, name in enumerate(targets.names)}


def tag_columns(rows: list[Tagged]) -> dict[str, list]:
    """A window's rows as a token classifier labelled them (Predictor.tagged), as labels_schema's columns:
    the text its entities' offsets index (a row of words: the words joined by spaces)."""
    return {
        "text": [row.text for row in rows],
        "entities": [row.entities for row in rows],
        "tags": [row.tags for row in rows],
    }


def labels_table(
    frame: pd.DataFrame, predicted: dict, schema: pa.Schema, first_row: int, name: str, reading: Reading
) -> pa.Table:
    """A window of labelled rows: their ids and texts (Reading.rows), and the predictions."""
    return pa.table(reading.rows(frame, first_row, name) | predicted, schema=schema)


def completed(output: layout.OutputFolder, job: str, files: list[str], model_uri: str, cfg: InferenceConfig) -> int:
    """Mark the job's files complete with what they hold and what they came from; returns their rows."""
    out_path, out_fs = storage.pyarrow_filesystem(output.uri)
    written = output.written(job)
    rows = pyarrow.dataset.dataset(
        [f"{out_path}/{name}" for name in written], filesystem=out_fs, format="parquet"
    ).count_rows()
    output.complete(
        job,
        written,
        {
            "rows": rows,
            "inputs": {uri: storage.fingerprint(uri) for uri in files},
            "model": {"uri": model_uri, "fingerprint": storage.fingerprint(model_uri)},
            "text_column": cfg.text_column,
            "text_pair_column": cfg.text_pair_column,
            "id_column": cfg.id_column,
            "pair_id_column": cfg.pair_id_column,
        },
    )
    return rows


def from_predictions(
    predictions: Predictions,
    thresholds: list[float] | None,
    test: Split,
    model_uri: str,
    cfg: InferenceConfig,
    output_uri: str,
) -> Labelled:
    """The test split's labels, as the trained engine predicted them by row (the split's rows run through
    its files in order), written where and as batch inference would write the model's: a Parquet file
    per input file, the same ids, the same record."""
    started, output = time.perf_counter(), layout.OutputFolder(output_uri)
    job = output.start()
    out_path, out_fs = storage.pyarrow_filesystem(output_uri)
    targets, reading = test.schema.targets, Reading.of(cfg)
    schema = labels_schema(targets, reading.pair_id_column is not None)
    row = 0
    for part, (uri, name) in enumerate(file_names(list(test.uris)).items()):
        first_in_file = row
        with pq.ParquetWriter(f"{out_path}/{job}_{part:05d}.parquet", schema, filesystem=out_fs) as out:
            for frame in iter_frames(uri, test.schema.format, cfg.window_rows):
                predicted = window_of(predictions, targets, thresholds, slice(row, row + len(frame)))
                out.write_table(labels_table(frame, predicted, schema, row - first_in_file, name, reading))
                row += len(frame)
    if row != predictions.rows:
        raise RuntimeError(f"the test split has {row} rows and training labelled {predictions.rows}")
    rows = completed(output, job, list(test.uris), model_uri, cfg)
    seconds = time.perf_counter() - started
    return Labelled(
        output_uri=output_uri,
        rows=rows,
        files=len(test.uris),
        seconds=round(seconds, 2),
        rows_per_s=round(rows / seconds, 1),
        actors=0,
        parts=len(test.uris),
    )


def window_of(predictions: Predictions, targets: Targets, thresholds: list[float] | None, rows: slice) -> dict:
    """The columns of a window of rows as training predicted them: a single-label model's classes and
    their probabilities as it gave them, other tasks' from their outputs."""
    if targets.task == "single_label":
        labels = np.asarray(predictions.labels[rows], dtype=np.int64)
        return {"label": np.asarray(targets.names)[labels], "score": np.asarray(predictions.scores[rows], np.float32)}
    return columns(targets, thresholds or [], np.asarray(predictions.outputs[rows], dtype=np.float32))
