"""`Labeller`: one batch-inference actor of tasks/infer/'s Ray Data pipeline. Each call takes one
part of an input file (a whole file, or a piece of a large one), reads it a window at a time, labels
each window with `Predictor` and writes the part's labels as one Parquet file.

Reading and writing happen in the actor rather than in Ray Data's read and write tasks: there,
each window crossed the object store twice and the reader and writer processes (their start, their
scheduling by the driver) took CPU from the models. On 2 CPUs, the tiny test model over 100,000
rows went from 6,020 to 6,893-7,856 rows/s (six runs); all-MiniLM-L6-v2, whose model is most of its
time, stayed at 220-236 rows/s over 10,000 rows.

Kept apart from the Prefect tasks: the actors import this module, and no Prefect.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
import pyarrow.parquet as pq
from pydantic import BaseModel

from tasks.contracts.labels import Reading, labels_schema
from tasks.core import progress
from tasks.core.config import InferenceConfig
from tasks.core.data import DataError
from tasks.core.files import Piece, file_format, iter_frames, reading
from tasks.infer.labels import columns, labels_table, tag_columns


class Counts(BaseModel):
    """An actor's running counts, tallied on the job's progress channel after each window."""

    parts: int = 0  # parts done
    bytes: int = 0  # of the parts done
    rows: int = 0  # of the parts done
    labelled: int = 0  # rows labelled so far, of parts done or not


@dataclass(frozen=True)
class Part:
    """What one actor call labels: a piece of one input file (its first row in the file numbers the
    default ids), the file's name in those ids, and the part's number, which names its output file.
    Flat, as a row of the Ray Data pipeline that hands parts to the actors."""

    uri: str
    start: int
    stop: int
    size: int
    file_row: int
    name: str
    part: int

    @property
    def piece(self) -> Piece:
        return Piece(self.uri, self.start, self.stop, self.size, file_row=self.file_row)


class Labeller:
    """Parts in (a Part a row), their row counts out; the labels of part number `part` in
    `<output>/<job>_<part>.parquet`, so a retried call overwrites its own
    file and the output folder's record knows the job's files."""

    def __init__(
        self,
        model_uri: str,
        output: tuple[str, object],
        job: str,
        cfg: InferenceConfig,
        threads: int,
        channel: str | None = None,
    ):
        from tasks.core.predictor import Predictor  # torch and transformers: in the actor only, not its driver

        self.predictor = Predictor(model_uri, cfg.batch_size, threads, precision=cfg.precision, engine=cfg.engine)
        self.reading, self.window_rows, self.format = Reading.of(cfg), cfg.window_rows, cfg.format
        self.schema = labels_schema(self.predictor.targets, self.reading.pair_id_column is not None)
        (self.path, self.filesystem), self.job = output, job
        self.channel, self.me, self.counts = channel, uuid.uuid4().hex, Counts()

    def __call__(self, parts: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({"rows": [self.label(Part(**row)) for row in parts.to_dict("records")]})

    def label(self, part: Part) -> int:
        piece, name, seen = part.piece, part.name, 0
        with pq.ParquetWriter(
            f"{self.path}/{self.job}_{part.part:05d}.parquet", self.schema, filesystem=self.filesystem
        ) as out:
            for frame in self.windows(piece):
                out.write_table(
                    labels_table(frame, self.predicted(frame), self.schema, piece.file_row + seen, name, self.reading)
                )
                seen += len(frame)
                self.counts.labelled += len(frame)
                self.tally()
        self.counts.parts, self.counts.bytes, self.counts.rows = (
            self.counts.parts + 1,
            self.counts.bytes + piece.size,
            self.counts.rows + seen,
        )
        self.tally()
        return seen

    def predicted(self, frame: pd.DataFrame) -> dict:
        """A window's predictions, as the columns labels_schema names."""
        predictor = self.predictor
        if predictor.targets.task == "token_classification":
            return tag_columns(predictor.tagged(frame[self.reading.text_column].tolist()))
        return columns(predictor.targets, predictor.thresholds, predictor.outputs(*self.reading.texts(frame)))

    def tally(self) -> None:
        if self.channel:
            progress.tally(self.channel, self.me, self.counts)

    def windows(self, piece: Piece) -> Iterator[pd.DataFrame]:
        """The piece's rows, window_rows at a time; the parser's errors (only theirs) as one DataError
        naming the file, which may be corrupt, or lack a column, past what the driver checked."""
        with reading(piece.uri, file_format(piece.uri, self.format)):
            for frame in iter_frames(piece.uri, self.format, chunk_rows=self.window_rows, piece=piece):
                missing = [column for column in self.reading.columns if column not in frame.columns]
                if missing:
                    raise DataError(f"{piece.uri}: column '{missing[0]}' not found")
                yield frame
