"""Reading labelled splits from any fsspec location, and validating them before cluster work.

Every problem raises DataError naming the file and what is wrong with it, so a bad input stops
the flow before Ray starts and before anything is written to storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

import pandas as pd
import pyarrow.parquet as pq

from tasks import storage
from tasks.config import DataConfig

EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet"}
SHOWN_ROWS = 5  # rows quoted in an error message


class DataError(ValueError):
    """Input data that ftflow refuses, with the file and the problem in the message."""


def file_format(uri: str, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    suffix = PurePosixPath(uri).suffix.lower()
    if suffix not in EXTENSIONS:
        raise DataError(f"{uri}: cannot tell the format from '{suffix}'; name one of {sorted(set(EXTENSIONS.values()))}")
    return EXTENSIONS[suffix]


def iter_frames(uri: str, fmt: str = "auto", chunk_rows: int = 50_000) -> Iterator[pd.DataFrame]:
    """Stream a file as DataFrames of at most chunk_rows rows; text stays text (no type guessing)."""
    fmt = file_format(uri, fmt)
    fs, path = storage.filesystem(uri)
    with fs.open(path, "rb") as f:
        if fmt == "parquet":
            for batch in pq.ParquetFile(f).iter_batches(batch_size=chunk_rows):
                yield batch.to_pandas()
        elif fmt == "jsonl":
            yield from pd.read_json(f, lines=True, dtype=False, chunksize=chunk_rows)
        else:
            sep = "\t" if fmt == "tsv" else ","
            yield from pd.read_csv(f, sep=sep, dtype=str, keep_default_na=False, chunksize=chunk_rows)


def read_frame(uri: str, fmt: str = "auto") -> pd.DataFrame:
    if not storage.exists(uri):
        raise DataError(f"{uri}: file not found")
    try:
        frames = list(iter_frames(uri, fmt))
    except DataError:
        raise
    except Exception as err:  # the parsers' own errors, reported against the file
        raise DataError(f"{uri}: cannot be read as {file_format(uri, fmt)}: {err}") from err
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


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
        found = [p for p in fs.find(path) if PurePosixPath(p).suffix.lower() in EXTENSIONS]
    elif any(ch in path for ch in "*?["):
        found = fs.glob(path)
    else:
        found = [path] if fs.exists(path) else []
    if not found:
        raise DataError(f"{uri}: no input files found")
    return [protocol + p for p in found]


@dataclass(frozen=True)
class Split:
    name: str
    uri: str
    sha256: str
    texts: list[str]
    labels: list[int]


def _rows(mask: pd.Series) -> str:
    rows = mask[mask].index[:SHOWN_ROWS].tolist()
    return f"rows {rows}{' ...' if mask.sum() > SHOWN_ROWS else ''}"


def _label_ids(uri: str, column: pd.Series, names: list[str]) -> list[int]:
    """Labels given as names or as ids (ints, or digit strings from CSV) -> ids."""
    by_name = {name: i for i, name in enumerate(names)}

    def to_id(value) -> int | None:
        if isinstance(value, str):
            if value in by_name:
                return by_name[value]
            value = int(value) if value.strip().isdigit() else None
        if isinstance(value, (int,)) and not isinstance(value, bool) and 0 <= value < len(names):
            return int(value)
        if isinstance(value, float) and value.is_integer() and 0 <= value < len(names):
            return int(value)
        return None

    ids = column.map(to_id)
    bad = ids.isna()
    if bad.any():
        values = sorted({repr(v) for v in column[bad]})[:SHOWN_ROWS]
        raise DataError(
            f"{uri}: column '{column.name}' has labels outside {names} (or ids 0..{len(names) - 1}): "
            f"{', '.join(values)} at {_rows(bad)}"
        )
    return ids.astype(int).tolist()


def load_split(name: str, uri: str, cfg: DataConfig) -> Split:
    uri = storage.normalize(uri)
    frame = read_frame(uri, cfg.format)
    if frame.empty:
        raise DataError(f"{uri}: the {name} split is empty")
    for column in (cfg.text_column, cfg.label_column):
        if column not in frame.columns:
            raise DataError(f"{uri}: column '{column}' not found; columns are {list(frame.columns)}")
    texts = frame[cfg.text_column]
    not_text = ~texts.map(lambda t: isinstance(t, str))
    if not_text.any():
        raise DataError(f"{uri}: column '{cfg.text_column}' has non-string values at {_rows(not_text)}")
    blank = texts.str.strip() == ""
    if blank.any():
        raise DataError(f"{uri}: column '{cfg.text_column}' has empty texts at {_rows(blank)}")
    labels = _label_ids(uri, frame[cfg.label_column], cfg.label_names)
    return Split(name, uri, storage.sha256(uri), texts.tolist(), labels)


def load_splits(cfg: DataConfig) -> dict[str, Split]:
    splits = {name: load_split(name, getattr(cfg, f"{name}_uri"), cfg) for name in ("train", "validation", "test")}
    train_classes = set(splits["train"].labels)
    if len(train_classes) < 2:
        only = cfg.label_names[train_classes.pop()]
        raise DataError(f"{splits['train'].uri}: the training split has a single class ('{only}'); it needs at least two")
    return splits
