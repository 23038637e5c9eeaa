"""Labelled splits, read from any fsspec location and validated before cluster work.

A split is one or more files, directories or globs (read as tasks/core/files.py reads any data file).
Every problem raises DataError naming the file and what is wrong with it, so a bad input stops the
flow before Ray starts and before anything is written to storage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from tasks.core import storage, tagging
from tasks.core.config import DataConfig
from tasks.core.files import (
    CHUNK_ROWS,
    CONLL_COLUMNS,
    DataError,
    Piece,
    cut,
    expand_inputs,
    file_format,
    iter_frames,
    reading,
    shown,
)
from tasks.core.targets import TargetError, Targets, rows_of

SPLITS = ("train", "validation", "test")


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
    subtokens: str = "first"  # token_classification: the sub-tokens of a word that carry its tag
    stride: int | None = None  # token_classification: tokens consecutive windows of a long text share

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
            cfg.subtokens,
            cfg.targets.stride,
        )

    @property
    def tagged(self) -> bool:
        """Whether a row is words and their tags (token_classification), not a text and its target."""
        return self.task == "token_classification"

    @property
    def text_columns(self) -> tuple[str, ...]:
        return (self.text_column, self.text_pair_column) if self.text_pair_column else (self.text_column,)

    @property
    def targets(self) -> Targets:
        pairs = self.truncation if self.text_pair_column else None
        return Targets(task=self.task, names=self.label_names, pairs=pairs, stride=self.stride)


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
    single-label class id one-hot; token_classification's: how many of the row's words have each tag."""
    if spec.task == "single_label":
        return np.eye(spec.width)[targets.to_numpy()]
    if spec.task == "token_classification":
        return np.array([np.bincount(ids, minlength=spec.width) for ids in targets], dtype=np.float64)
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


def has_columns(uri: str, frame: pd.DataFrame, columns: Sequence[str]) -> None:
    for column in columns:
        if column not in frame.columns:
            raise DataError(f"{uri}: column '{column}' not found; columns are {list(frame.columns)}")


def _checked(uri: str, frame: pd.DataFrame, schema: Schema) -> pd.DataFrame:
    """A chunk's rows as (text[, text_pair], label), each checked: token_classification's as (words,
    tag ids)."""
    has_columns(uri, frame, (*schema.text_columns, *schema.label_columns))
    if schema.tagged:
        return tagging.tagged(uri, frame, schema.text_column, schema.label_columns[0], schema.label_names)
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
        for frame in read_frames(uri, schema, chunk_rows, piece):
            frame.index = pd.RangeIndex(seen, seen + len(frame))  # Parquet batches each start at 0
            seen += len(frame)
            yield _checked(uri, frame, schema)


def read_frames(uri: str, schema: Schema, chunk_rows: int = CHUNK_ROWS, piece: Piece | None = None):
    """A file's rows as read, a CoNLL file's words and tags under the schema's column names."""
    conll = dict(zip(CONLL_COLUMNS, (schema.text_column, schema.label_columns[0]), strict=True))
    for frame in iter_frames(uri, schema.format, chunk_rows, piece):
        yield frame.rename(columns=conll) if file_format(uri, schema.format) == "conll" else frame


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
    if targets.task == "token_classification" and set(train.classes) <= {targets.names.index(tagging.OUTSIDE)}:
        raise DataError(f"{shown(train.uris)}: the training split tags every word O: no entity to learn")
    if targets.task == "regression":
        for column, least, most in zip(train.schema.label_columns, train.tally.least, train.tally.most, strict=True):
            if least == most:
                raise DataError(
                    f"{shown(train.uris)}: column '{column}' is constant ({least:g}) in the training split: "
                    "nothing to learn"
                )


def load_splits(cfg: DataConfig) -> dict[str, Split]:
    if cfg.task == "token_classification" and cfg.label_names is None:
        cfg = cfg.model_copy(update={"label_names": list(training_tags(cfg))})
    splits = {name: load_split(name, getattr(cfg, f"{name}_uri"), cfg) for name in SPLITS}
    check_training_targets(splits["train"])
    return splits


def training_tags(cfg: DataConfig) -> tuple[str, ...]:
    """The tags of the training split's words (token_classification without label_names): one read
    of its files before the checked one, which takes them as the model's outputs."""
    files, schema, found = expand_inputs(cfg.train_uri), Schema.of(cfg), set()
    for uri in files:
        with reading(uri, file_format(uri, schema.format)):
            for frame in read_frames(uri, schema):
                has_columns(uri, frame, (schema.text_column, schema.label_columns[0]))
                given = tagging.given_rows(uri, frame, schema.text_column, schema.label_columns[0])
                found.update(tag for tags in given["tags"] for tag in tags)
    return tagging.tag_names(found, shown(files))
