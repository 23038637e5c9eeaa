"""Data in: every format, any fsspec location, and a clear early error for each bad input."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import BUCKET, write_jsonl
from tasks import storage
from tasks.config import DataConfig
from tasks.data import DataError, load_split, load_splits

ROWS = [{"text": "a fine film", "label": 1}, {"text": "a dull film", "label": 0}, {"text": "great", "label": 1}]


def write(frame: pd.DataFrame, path, fmt: str):
    if fmt == "jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif fmt == "parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, sep="\t" if fmt == "tsv" else ",", index=False)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "parquet"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    path = write(pd.DataFrame(ROWS), tmp_path / f"train.{fmt}", fmt)
    split = load_split("train", str(path), DataConfig())
    assert split.texts == [r["text"] for r in ROWS]
    assert split.labels == [1, 0, 1]
    assert split.sha256 == storage.sha256(str(path))


def test_custom_columns_and_label_names(tmp_path):
    frame = pd.DataFrame({"review": ["good", "bad", "meh"], "sentiment": ["pos", "neg", "neu"]})
    path = write(frame, tmp_path / "train.csv", "csv")
    cfg = DataConfig(text_column="review", label_column="sentiment", label_names=["neg", "neu", "pos"])
    assert load_split("train", str(path), cfg).labels == [2, 0, 1]


def test_reads_from_s3(s3_endpoint, tmp_path):
    path = write(pd.DataFrame(ROWS), tmp_path / "train.parquet", "parquet")
    uri = f"s3://{BUCKET}/data-test/train.parquet"
    storage.filesystem(uri)[0].put_file(str(path), uri)
    split = load_split("train", uri, DataConfig())
    assert split.uri == uri and split.labels == [1, 0, 1]


BAD_INPUTS = {
    "missing file": (None, "file not found"),
    "missing column": ([{"body": "x", "label": 1}], "column 'text' not found"),
    "empty split": ([], "split is empty"),
    "non-string text": ([{"text": 42, "label": 1}, {"text": "ok", "label": 0}], "non-string values at rows [0]"),
    "empty text": ([{"text": "ok", "label": 1}, {"text": "  ", "label": 0}], "empty texts at rows [1]"),
    "label outside set": ([{"text": "ok", "label": 1}, {"text": "no", "label": 7}], "labels outside ['negative', 'positive']"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_file_and_problem(tmp_path, case):
    rows, message = BAD_INPUTS[case]
    path = tmp_path / "train.jsonl"
    if rows is not None:
        path.write_text("") if not rows else write_jsonl(path, rows)
    with pytest.raises(DataError) as err:
        load_split("train", str(path), DataConfig())
    assert str(path) in str(err.value) and message in str(err.value)


def test_single_class_training_split_is_refused(tmp_path, small_data):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "good", "label": 1}, {"text": "fine", "label": 1}])
    cfg = DataConfig(train_uri=str(train), validation_uri=str(small_data["validation"]), test_uri=str(small_data["test"]))
    with pytest.raises(DataError, match=f"{train}: the training split has a single class \\('positive'\\)"):
        load_splits(cfg)
