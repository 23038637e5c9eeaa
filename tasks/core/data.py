"""Reading labelled splits from any fsspec location, and validating them before cluster work.

A split is one or more files, directories or globs. Every problem raises DataError naming the file
and what is wrong with it, so a bad input stops the flow before Ray starts and before anything is
written to storage. Files are read in chunks of CHUNK_ROWS rows, here and in the Ray workers, so
memory follows the chunk size, never the file size; and as pieces of at most PIECE_BYTES, so one
huge file is still read by many workers at once. A compressed text file (train.jsonl.gz) is read as
it streams, but as one piece: a compressed stream has no byte offsets to start a piece at.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise
from pathlib import PurePosixPath

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from fsspec.compression import compr

from tasks.core import storage
from tasks.core.config import DataConfig
from tasks.core.targets import SHOWN, TargetError, Targets, rows_of

SPLITS = ("train", "validation", "test")
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
# What pandas, Ray Data and `datasets` decompress by the file's last suffix, for every format but
# Parquet (which compresses its own pages); fsspec's codecs (zstandard for .zst) read them.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
CHUNK_ROWS = 10_000  # rows in memory at once per reader of a split's file
PIECE_BYTES = 8 << 20  # the most of one file a worker task is given: pieces are what tasks balance
# UTF-8, with or without the byte-order mark that spreadsheets and many Windows tools write first:
# read as utf-8, pandas' JSON reader took it for a value ("Expected object or value at position 0").
# Only a file's first piece starts with it; the content hash still reads the bytes as they are.
TEXT_ENCODING = "utf-8-sig"


class DataError(ValueError):
    """Input data that ftflow refuses, with the file and the problem in the message."""


def compression_of(uri: str) -> str | None:
    """The codec a file is compressed with, from its last suffix (None: not compressed)."""
    return COMPRESSIONS.get(PurePosixPath(uri).suffix.lower())


def format_suffix(uri: str) -> str:
    """The suffix that names a file's format: train.jsonl.gz's is '.jsonl'."""
    path = PurePosixPath(uri)
    return (path.with_suffix("") if compression_of(uri) else path).suffix.lower()


def is_data_file(uri: str) -> bool:
    return format_suffix(uri) in EXTENSIONS


def file_format(uri: str, declared: str = "auto") -> str:
    suffix = format_suffix(uri)
    if declared == "auto" and suffix not in EXTENSIONS:
        raise DataError(
            f"{uri}: cannot tell the format from '{suffix}'; name one of {sorted(set(EXTENSIONS.values()))}"
            f", compressed or not ({', '.join(COMPRESSIONS)})"
        )
    fmt = EXTENSIONS[suffix] if declared == "auto" else declared
    if fmt == "parquet" and compression_of(uri):
        raise DataError(f"{uri}: a Parquet file compresses its own pages; give it uncompressed (.parquet)")
    return fmt


def open_data(uri: str):
    """A data file opened for reading, decompressed as it is read when its suffix names a codec."""
    fs, path = storage.filesystem(uri)
    return fs.open(path, "rb", compression=compression_of(uri))


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one file that one task reads: for JSONL the lines that start in bytes
    [start, stop), for Parquet row groups [start, stop); CSV and TSV files are read whole (a quoted
    field may hold a newline, so bytes alone cannot tell where a row starts). `rows`, `first_row`
    (in the split) and `file_row` (in the file) are known once the piece has been checked; a
    Parquet piece's `file_row` already from the footer."""

    uri: str
    start: int
    stop: int
    size: int  # bytes, to balance pieces across tasks
    rows: int = 0
    first_row: int = 0
    file_row: int = 0


@contextmanager
def reading(uri: str, fmt: str) -> Iterator[None]:
    """The parsers' own errors (pyarrow's name no file), as one DataError naming the file."""
    try:
        yield
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{uri}: cannot be read as {fmt}: {err}") from err


def cut(uri: str, fmt: str = "auto", piece_bytes: int | None = None) -> list[Piece]:
    """A file as pieces of about piece_bytes (PIECE_BYTES unless given; at least one piece)."""
    fmt, piece_bytes = file_format(uri, fmt), piece_bytes or PIECE_BYTES
    fs, path = storage.filesystem(uri)
    size = fs.size(path)
    if fmt == "parquet":
        with fs.open(path, "rb") as f, reading(uri, fmt):
            meta = pq.ParquetFile(f).metadata
        pieces, start, taken, first, row = [], 0, 0, 0, 0
        for group in range(meta.num_row_groups):
            group_bytes = meta.row_group(group).total_byte_size
            if taken and taken + group_bytes > piece_bytes:
                pieces.append(Piece(uri, start, group, taken, file_row=first))
                start, taken, first = group, 0, row
            taken += group_bytes
            row += meta.row_group(group).num_rows
        return [*pieces, Piece(uri, start, meta.num_row_groups, taken, file_row=first)]
    count = max(1, -(-size // piece_bytes)) if fmt == "jsonl" and not compression_of(uri) else 1
    bounds = [size * i // count for i in range(count + 1)]
    return [Piece(uri, start, stop, stop - start) for start, stop in pairwise(bounds)]


class _Lines(io.RawIOBase):
    """The lines of a file that start in bytes [start, stop), as a file the parsers read whole. Each
    line belongs to the piece its first byte is in, so consecutive pieces hold every line once."""

    def __init__(self, f, start: int, stop: int) -> None:
        f.seek(max(0, start - 1))
        if start:
            f.readline()  # the line under way at `start` is the previous piece's
        self.f, self.stop, self.pending = f, stop, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self.pending and self.f.tell() < self.stop:
            self.pending = self.f.read(min(len(buffer), self.stop - self.f.tell()))
            if self.f.tell() >= self.stop and self.pending and not self.pending.endswith(b"\n"):
                self.pending += self.f.readline()  # the line that crosses `stop` is this piece's
        taken, self.pending = self.pending[: len(buffer)], self.pending[len(buffer) :]
        buffer[: len(taken)] = taken
        return len(taken)


def iter_frames(
    uri: str, fmt: str = "auto", chunk_rows: int = 50_000, piece: Piece | None = None
) -> Iterator[pd.DataFrame]:
    """Stream a file, or one piece of it, as DataFrames of 1 to chunk_rows rows; text stays text (no
    type guessing). None of no rows: pandas reads a CSV of its header alone as one, which the checks
    tallied as rows (numpy's `zero-size array to reduction operation minimum`, naming no file)
    rather than finding the split empty."""
    for frame in _frames(uri, file_format(uri, fmt), chunk_rows, piece):
        if len(frame):
            yield frame


def _frames(uri: str, fmt: str, chunk_rows: int, piece: Piece | None) -> Iterator[pd.DataFrame]:
    with open_data(uri) as f:
        if fmt == "parquet":
            groups = range(piece.start, piece.stop) if piece else None
            for batch in pq.ParquetFile(f).iter_batches(batch_size=chunk_rows, row_groups=groups):
                yield batch.to_pandas()
        elif fmt == "jsonl":
            whole = piece is None or compression_of(uri)  # a compressed file is one piece
            lines = f if whole else io.BufferedReader(_Lines(f, piece.start, piece.stop), 1 << 20)
            yield from pd.read_json(lines, lines=True, dtype=False, chunksize=chunk_rows, encoding=TEXT_ENCODING)
        else:
            sep = "\t" if fmt == "tsv" else ","
            yield from pd.read_csv(
                f, sep=sep, dtype=str, keep_default_na=False, chunksize=chunk_rows, encoding=TEXT_ENCODING
            )


def numbered(pieces: list[Piece], fmt: str = "auto") -> list[Piece]:
    """One file's pieces (from `cut`), each with `file_row`, the number of its first row in the file.
    `cut` numbers Parquet's from the footer and a CSV is one piece; JSONL's are numbered by counting
    the rows of every piece but the last as the reader parses them (one per line; pandas skips
    blank ones), which reads those pieces once."""
    if len(pieces) < 2 or file_format(pieces[0].uri, fmt) != "jsonl":
        return pieces
    fs, path = storage.filesystem(pieces[0].uri)
    with fs.open(path, "rb") as f:
        rows = [
            sum(1 for line in io.BufferedReader(_Lines(f, piece.start, piece.stop), 1 << 20) if line.strip())
            for piece in pieces[:-1]
        ]
    return [replace(piece, file_row=first) for piece, first in zip(pieces, accumulate(rows, initial=0), strict=True)]


def columns_of(uri: str, fmt: str = "auto") -> list[str] | None:
    """A file's columns, from its Parquet footer, its CSV header or its first row (None: an empty
    JSONL file's): enough to refuse a file without the configured columns before any cluster work,
    without reading the corpus."""
    fmt = file_format(uri, fmt)
    with reading(uri, fmt):
        if fmt == "parquet":
            fs, path = storage.filesystem(uri)
            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).schema_arrow.names
        first = next(_frames(uri, fmt, chunk_rows=1, piece=None), None)  # a CSV's header alone is a frame
        return None if first is None else list(first.columns)


def check_columns(files: list[str], columns: Sequence[str]) -> None:
    """Each file, read as its format, holds the columns."""
    for uri in files:
        found = columns_of(uri)
        missing = [column for column in columns if found is not None and column not in found]
        if missing:
            raise DataError(f"{uri}: column '{missing[0]}' not found; columns are {found}")


def rows_per_byte(uri: str, fmt: str = "auto", sample_bytes: int = 1 << 20) -> float:
    """A file's rows per byte as stored, from its Parquet footer or from the lines in its first MiB
    (of text, and per compressed byte read for it where compressed): enough to size work from file
    sizes without reading the corpus."""
    fmt, codec = file_format(uri, fmt), compression_of(uri)
    fs, path = storage.filesystem(uri)
    with fs.open(path, "rb") as raw:
        if fmt == "parquet":
            return pq.ParquetFile(raw).metadata.num_rows / max(1, fs.size(path))
        if codec is None:
            head = raw.read(sample_bytes)
            return head.count(b"\n") / max(1, len(head))
        with compr[codec](raw, mode="rb") as text:  # zstandard's reader closes `raw` with it
            lines, read = text.read(sample_bytes).count(b"\n"), raw.tell()
        return lines / max(1, read)


def expand_inputs(uris: str | list[str]) -> list[str]:
    """Files, directories (every data file under them) or globs, as one sorted list of file URIs."""
    uris = [uris] if isinstance(uris, str) else uris
    if not uris:
        raise DataError("no inputs given: name at least one file, directory or glob")
    return sorted({found for uri in uris for found in _expand(uri)})


def _expand(uri: str) -> list[str]:
    fs, path = storage.filesystem(uri)
    protocol = uri.split("://")[0] + "://" if storage.is_remote(uri) else ""
    if fs.isdir(path):
        found = [p for p in fs.find(path) if is_data_file(p)]
    elif any(ch in path for ch in "*?["):
        found = fs.glob(path)
    elif fs.exists(path):
        found = [path]
    else:
        raise DataError(f"{uri}: file not found")
    if not found:
        raise DataError(f"{uri}: no input files found")
    return [protocol + p for p in found]


def shown(uris: Sequence[str]) -> str:
    """Files named in a message: all of a few, the first few of many."""
    return ", ".join(uris[:SHOWN]) + (f" ... ({len(uris)} files)" if len(uris) > SHOWN else "")


@dataclass(frozen=True)
class Schema:
    """How every file of every split is read: the same for the driver's checks and the workers."""

    format: str
    text_column: str
    label_columns: tuple[str, ...]  # one, or regression's several outputs
    task: str
    label_names: tuple[str, ...]  # the outputs' names: classes, labels, or the label columns
    label_separator: str | None = None
    text_pair_column: str | None = None
    truncation: str = "longest_first"  # which text of a pair loses tokens

    @classmethod
    def of(cls, cfg: DataConfig) -> Schema:
        columns = (cfg.label_column,) if isinstance(cfg.label_column, str) else tuple(cfg.label_column)
        return cls(
            cfg.format,
            cfg.text_column,
            columns,
            cfg.task,
            cfg.targets.names,
            cfg.label_separator,
            cfg.text_pair_column,
            cfg.truncation,
        )

    @property
    def text_columns(self) -> tuple[str, ...]:
        return (self.text_column, self.text_pair_column) if self.text_pair_column else (self.text_column,)

    @property
    def targets(self) -> Targets:
        pairs = self.truncation if self.text_pair_column else None
        return Targets(task=self.task, names=self.label_names, pairs=pairs)


@dataclass(frozen=True)
class Tally:
    """A split's targets summed up as it is read, per output: its rows with that class or label (a
    number's sum, for regression), its least and greatest value; and the most labels a row has."""

    rows: int
    sums: tuple[float, ...]
    least: tuple[float, ...]
    most: tuple[float, ...]
    labels_per_row: float

    @classmethod
    def of(cls, matrix: np.ndarray) -> Tally:
        """The tally of a chunk's targets, a row per row and a column per output."""
        return cls(
            len(matrix),
            tuple(matrix.sum(0).tolist()),
            tuple(matrix.min(0).tolist()),
            tuple(matrix.max(0).tolist()),
            float(matrix.sum(1).max()),
        )

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.rows + other.rows,
            tuple(map(sum, zip(self.sums, other.sums, strict=True))),
            tuple(map(min, zip(self.least, other.least, strict=True))),
            tuple(map(max, zip(self.most, other.most, strict=True))),
            max(self.labels_per_row, other.labels_per_row),
        )

    @property
    def means(self) -> tuple[float, ...]:
        """Per output, the mean target: a class's or a label's share of the rows, a number's mean."""
        return tuple(total / self.rows for total in self.sums)


def target_matrix(targets: pd.Series, spec: Targets) -> np.ndarray:
    """Parsed targets (Targets.parse) as a matrix, a row per row and a column per output: a
    single-label class id one-hot."""
    if spec.task == "single_label":
        return np.eye(spec.width)[targets.to_numpy()]
    return np.array(targets.tolist(), dtype=np.float64).reshape(len(targets), spec.width)


@dataclass(frozen=True)
class Split:
    """A checked split: where its rows are, never the rows themselves (readers stream them)."""

    name: str
    uris: tuple[str, ...]  # sorted: global row numbers run through the files in this order
    pieces: tuple[Piece, ...]  # in the same order, each with its row count and first row
    sha256: str  # the file's own when there is one, else over the files' hashes in order
    tally: Tally
    schema: Schema

    @property
    def total_rows(self) -> int:
        return sum(piece.rows for piece in self.pieces)

    @property
    def targets(self) -> Targets:
        """The schema's, with the split's means as the priors a model's classifier starts at."""
        return self.schema.targets.model_copy(update={"priors": self.tally.means})

    @property
    def classes(self) -> frozenset[int]:
        """The class or label ids some row has (classification)."""
        return frozenset(i for i, total in enumerate(self.tally.sums) if total > 0)


def check_texts(uri: str, texts: pd.Series) -> None:
    not_text = ~texts.map(lambda t: isinstance(t, str))
    if not_text.any():
        raise DataError(f"{uri}: column '{texts.name}' has non-string values at {rows_of(not_text)}")
    blank = texts.str.strip() == ""
    if blank.any():
        raise DataError(f"{uri}: column '{texts.name}' has empty texts at {rows_of(blank)}")


def _checked(uri: str, frame: pd.DataFrame, schema: Schema) -> pd.DataFrame:
    """A chunk's rows as (text[, text_pair], label), each checked."""
    for column in (*schema.text_columns, *schema.label_columns):
        if column not in frame.columns:
            raise DataError(f"{uri}: column '{column}' not found; columns are {list(frame.columns)}")
    for column in schema.text_columns:
        check_texts(uri, frame[column])
    try:
        label = schema.targets.parse(frame[list(schema.label_columns)], schema.label_separator)
    except TargetError as error:
        raise DataError(f"{uri}: {error}") from None
    texts = dict(zip(("text", "text_pair"), (frame[column] for column in schema.text_columns), strict=False))
    return pd.DataFrame(texts | {"label": label})


def labelled_frames(
    uri: str, schema: Schema, chunk_rows: int = CHUNK_ROWS, piece: Piece | None = None
) -> Iterator[pd.DataFrame]:
    """A file's rows (or a piece's), checked, as frames of (text, label id) indexed by the row
    number in the file."""
    seen = piece.file_row if piece else 0
    with reading(uri, file_format(uri, schema.format)):
        for frame in iter_frames(uri, schema.format, chunk_rows, piece):
            frame.index = pd.RangeIndex(seen, seen + len(frame))  # Parquet batches each start at 0
            seen += len(frame)
            yield _checked(uri, frame, schema)


def combined_sha256(uris: Sequence[str]) -> str:
    """A one-file split's hash is the file's own (what sha256sum prints, as manifests always held);
    several files hash their hashes in order, so moving bytes between files changes it too."""
    hashes = [storage.sha256(uri) for uri in uris]
    return hashes[0] if len(hashes) == 1 else hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def load_split(name: str, uris: str | list[str], cfg: DataConfig) -> Split:
    """Read every row of the split once, piece by piece and chunk by chunk, to refuse bad input
    early; keep only counts."""
    files, schema = tuple(expand_inputs(uris)), Schema.of(cfg)
    pieces, tallies, first_row = [], [], 0
    for uri in files:
        file_row = 0
        for piece in cut(uri, schema.format):
            piece = replace(piece, first_row=first_row, file_row=file_row)
            for frame in labelled_frames(uri, schema, piece=piece):
                file_row += len(frame)
                tallies.append(Tally.of(target_matrix(frame["label"], schema.targets)))
            pieces.append(replace(piece, rows=file_row - piece.file_row))
            first_row += pieces[-1].rows
    if not first_row:
        raise DataError(f"{shown(files)}: the {name} split is empty")
    split = Split(name, files, tuple(pieces), combined_sha256(files), sum(tallies[1:], tallies[0]), schema)
    check_separator(split)
    return split


def check_separator(split: Split) -> None:
    """A multi-label separator that splits no row's labels is not the data's (or the data has one
    label a row, and should say so as single_label)."""
    separator = split.schema.label_separator
    if separator and split.tally.labels_per_row <= 1:
        raise DataError(
            f"{shown(split.uris)}: data.label_separator {separator!r} splits no row of column "
            f"'{split.schema.label_columns[0]}' into several labels"
        )


def check_training_targets(train: Split) -> None:
    """What a model cannot learn from: one class only (single_label), a constant number (regression)."""
    targets = train.schema.targets
    if targets.task == "single_label" and len(train.classes) < 2:
        only = targets.names[next(iter(train.classes))]
        raise DataError(f"{shown(train.uris)}: the training split has a single class ('{only}'); it needs at least two")
    if targets.task == "regression":
        for column, least, most in zip(train.schema.label_columns, train.tally.least, train.tally.most, strict=True):
            if least == most:
                raise DataError(
                    f"{shown(train.uris)}: column '{column}' is constant ({least:g}) in the training split: "
                    "nothing to learn"
                )


def load_splits(cfg: DataConfig) -> dict[str, Split]:
    splits = {name: load_split(name, getattr(cfg, f"{name}_uri"), cfg) for name in SPLITS}
    check_training_targets(splits["train"])
    return splits
