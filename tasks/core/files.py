"""Data files, at any fsspec location: their formats and compressions, globs and folders expanded,
each cut into pieces of at most PIECE_BYTES (so one huge file is still read by many workers at once)
and read in frames of CHUNK_ROWS rows (so memory follows the chunk size, never the file size). A
compressed text file (train.jsonl.gz) is read as it streams, but as one piece: a compressed stream
has no byte offsets to start a piece at. Every problem raises DataError naming the file. The labelled
splits built on them are tasks/core/data.py."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise
from pathlib import PurePosixPath

import pandas as pd
import pyarrow.parquet as pq
from fsspec.compression import compr

from tasks.core import storage
from tasks.core.targets import SHOWN

EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".conll": "conll",
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
CONLL_COLUMNS = ("words", "tags")  # a CoNLL file's rows, as its frames hold them
LINE = "_line"  # a CoNLL frame's column: the line each sentence starts at, for messages


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
        elif fmt == "conll":
            yield from conll_frames(io.TextIOWrapper(f, encoding=TEXT_ENCODING), uri, chunk_rows)
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


def check_columns(files: list[str], columns: Sequence[str], fmt: str = "auto") -> None:
    """Each file, read as its format, holds the columns."""
    for uri in files:
        found = columns_of(uri, fmt)
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


def conll_frames(text: io.TextIOBase, uri: str, chunk_rows: int) -> Iterator[pd.DataFrame]:
    """A CoNLL file's sentences, chunk_rows at a time, as frames of (words, tags, the sentence's first
    line). A token a line, its tag in the last column (tabs between columns, else spaces); a sentence
    ends at a line that is empty or only whitespace (WNUT-17 writes a lone tab); -DOCSTART- lines are
    skipped. Every token line must have as many columns as the file's first."""
    rows, words, tags, columns, first = [], [], [], None, 0
    for number, line in enumerate(text, start=1):
        parts = [part.strip() for part in (line.split("\t") if "\t" in line.strip() else line.split())]
        if not line.strip() or parts[0] == "-DOCSTART-":
            if words:
                rows.append((words, tags, first))
                words, tags = [], []
            if len(rows) == chunk_rows:
                yield pd.DataFrame(rows, columns=[*CONLL_COLUMNS, LINE])
                rows = []
            continue
        columns = columns or len(parts)
        if columns < 2:
            raise DataError(f"{uri}: line {number} has one column: a CoNLL line is a token, then its tag last")
        if len(parts) != columns:
            raise DataError(f"{uri}: line {number} has {len(parts)} columns, the file's first token line {columns}")
        first = first if words else number
        words.append(parts[0])
        tags.append(parts[-1])
    if words:
        rows.append((words, tags, first))
    if rows:
        yield pd.DataFrame(rows, columns=[*CONLL_COLUMNS, LINE])
