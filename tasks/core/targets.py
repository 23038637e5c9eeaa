"""What a row's target is, for each `data.task`, and how a split's targets are read from its label
column(s): the one place that knows the three shapes of problem. Imports no torch, Ray or Prefect.

- single_label: one class id per row (transformers' single_label_classification: cross-entropy);
- multi_label: any number of labels per row, none included, held as a multi-hot row of floats
  (multi_label_classification: binary cross-entropy per label);
- regression: one number per output column (regression: mean squared error);
- token_classification: a tag per word (a model *ForTokenClassification: cross-entropy per token), the
  rows read by tasks/core/tagging.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel

Task = Literal["single_label", "multi_label", "regression", "token_classification"]
Truncation = Literal["longest_first", "only_first", "only_second"]  # which text of a pair loses tokens
PROBLEM_TYPES: dict[str, str | None] = {
    "single_label": "single_label_classification",
    "multi_label": "multi_label_classification",
    "regression": "regression",
    "token_classification": None,  # transformers' problem_type is a sequence classifier's only
}
# What each task's model is scored by on the test split, the promotion gate's default first.
METRICS: dict[str, tuple[str, ...]] = {
    "single_label": ("accuracy", "macro_f1"),
    "multi_label": ("micro_f1", "macro_f1", "subset_accuracy"),
    "regression": ("mse", "mae", "pearson", "spearman"),
    "token_classification": ("entity_f1", "entity_precision", "entity_recall", "token_accuracy"),
}
LOWER_IS_BETTER = frozenset({"mse", "mae"})
# Where each metric's scores lie: a promotion floor (promotion.min_score) outside is no score at all.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0, 1),
    "macro_f1": (0, 1),
    "micro_f1": (0, 1),
    "subset_accuracy": (0, 1),
    "mse": (0, math.inf),
    "mae": (0, math.inf),
    "pearson": (-1, 1),
    "spearman": (-1, 1),
    "entity_f1": (0, 1),
    "entity_precision": (0, 1),
    "entity_recall": (0, 1),
    "token_accuracy": (0, 1),
}
SHOWN = 5  # values and rows quoted in an error message


def task_of(config: dict) -> Task:
    """A saved model's task, from its config (config.json's fields): a token classifier by its
    architecture, else by its problem_type (None: a classifier saved without one, as models from
    elsewhere and ftflow's before data.task are)."""
    if any(name.endswith("ForTokenClassification") for name in config.get("architectures") or []):
        return "token_classification"
    problem_type = config.get("problem_type")
    return next((task for task, kind in PROBLEM_TYPES.items() if problem_type and kind == problem_type), "single_label")


class TargetError(ValueError):
    """Targets a column cannot hold, said without the file: data.py adds it."""


class Targets(BaseModel, frozen=True):
    """What a model of the task reads and says: the names of its outputs, in id order (classes for
    single_label, labels for multi_label, the target columns for regression), and whether it reads a
    pair of texts (`pairs`: which of the two loses tokens past the length; None: one text)."""

    task: Task = "single_label"
    names: tuple[str, ...]
    pairs: Truncation | None = None
    # Per output, its training rows' mean: a label's share (multi_label), a number's mean (regression).
    # The model's classifier starts there (tasks/train/engine.py), from the data (tasks/core/data.py).
    priors: tuple[float, ...] | None = None
    # token_classification: tokens two consecutive windows of a text longer than the model's length share
    stride: int | None = None

    @property
    def width(self) -> int:
        return len(self.names)

    @property
    def problem_type(self) -> str | None:
        return PROBLEM_TYPES[self.task]

    def parse(self, labels: pd.DataFrame, separator: str | None = None) -> pd.Series:
        """The label column(s) of a chunk of rows -> a target per row: a class id (single_label), a
        multi-hot list of floats (multi_label) or the outputs' numbers (regression). A value it
        cannot take raises TargetError naming the column, the values and their rows."""
        if self.task == "regression":
            return regression_targets(labels)
        column = labels.iloc[:, 0]
        if self.task == "single_label":
            return class_ids(column, self.names)
        return multi_hot(column, self.names, separator)


def rows_of(mask: pd.Series) -> str:
    rows = mask[mask].index[:SHOWN].tolist()
    return f"rows {rows}{' ...' if mask.sum() > SHOWN else ''}"


def label_id(value, by_name: dict[str, int]) -> int | None:
    """A label given as its name or its id (an int, a whole float, or digits from CSV) -> its id."""
    if isinstance(value, str):
        if value in by_name:
            return by_name[value]
        value = int(value) if value.strip().isdigit() else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < len(by_name):
        return int(value)
    return None


def ids_by_name(names: Sequence[str]) -> dict[str, int]:
    return {name: i for i, name in enumerate(names)}


def refuse(column: pd.Series, bad: pd.Series, problem: str) -> TargetError:
    values = sorted({repr(v) for v in column[bad]})[:SHOWN]
    return TargetError(f"column '{column.name}' has {problem}: {', '.join(values)} at {rows_of(bad)}")


def class_ids(column: pd.Series, names: Sequence[str]) -> pd.Series:
    by_name = ids_by_name(names)
    ids = column.map(lambda value: label_id(value, by_name))
    bad = ids.isna()
    if bad.any():
        raise refuse(column, bad, f"labels outside {list(names)} (or ids 0..{len(names) - 1})")
    return ids.astype("int64")


def listed(value, separator: str | None) -> list | None:
    """A multi-label cell as its list of labels: a list (JSON), a string split by the separator (one
    label without one), or nothing (None, NaN, "") for no label; None where it is none of these."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return list(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, str):
        parts = value.split(separator) if separator else [value]
        return [part.strip() for part in parts if part.strip()]
    return [value] if isinstance(value, (int, np.integer)) else None


def multi_hot(column: pd.Series, names: Sequence[str], separator: str | None) -> pd.Series:
    """Each row's labels as a multi-hot list over `names`."""
    by_name = ids_by_name(names)

    def hot(value) -> list[float] | None:
        labels = listed(value, separator)
        ids = None if labels is None else [label_id(label, by_name) for label in labels]
        if ids is None or None in ids:
            return None
        row = [0.0] * len(names)
        for i in ids:
            row[i] = 1.0
        return row

    rows = column.map(hot)
    bad = rows.isna()
    if bad.any():
        given = f", split by {separator!r}" if separator else ""
        raise refuse(column, bad, f"labels outside {list(names)} (or ids 0..{len(names) - 1}{given})")
    return rows


def regression_targets(columns: pd.DataFrame) -> pd.Series:
    """Each row's numbers, one per column; numbers written as text (CSV) read as numbers."""
    numbers = columns.apply(lambda column: pd.to_numeric(column, errors="coerce"))
    for name in columns.columns:
        bad = ~np.isfinite(numbers[name].astype("float64"))
        if bad.any():
            raise refuse(columns[name], bad, "values that are not finite numbers")
    return pd.Series(numbers.astype("float32").to_numpy().tolist(), index=columns.index)
