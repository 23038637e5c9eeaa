"""The `batch_infer` flow: many files, several formats, exactly one prediction per input row."""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import write_jsonl
from flows.batch_infer import batch_infer
from tasks.data import DataError


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    write_jsonl(folder / "a.jsonl", [{"text": f"review {i} was good"} for i in range(300)])
    (folder / "sub").mkdir()
    pd.DataFrame({"text": [f"film {i} bored me" for i in range(200)]}).to_csv(folder / "sub" / "b.csv", index=False)
    pd.DataFrame({"text": [f"plot {i}" for i in range(100)], "doc": [f"d{i}" for i in range(100)]}).to_parquet(folder / "c.parquet")
    return folder


def test_every_row_of_every_file_gets_one_prediction(ray_cluster, tiny_model, corpus, tmp_path):
    out = batch_infer(str(tiny_model), str(corpus), str(tmp_path / "predictions"))
    assert out == {"output_uri": str(tmp_path / "predictions"), "rows": 600, "files": 3}
    table = pq.read_table(tmp_path / "predictions").to_pandas().set_index("id")
    expected = {f"a.jsonl:{i}": f"review {i} was good" for i in range(300)}
    expected |= {f"sub/b.csv:{i}": f"film {i} bored me" for i in range(200)}
    expected |= {f"c.parquet:{i}": f"plot {i}" for i in range(100)}
    assert table.index.is_unique and table["text"].to_dict() == expected
    assert set(table["label"]) <= {"LABEL_0", "LABEL_1"}


def test_id_column_and_rerun_replaces_output(ray_cluster, tiny_model, corpus, tmp_path):
    out_dir = tmp_path / "predictions"
    batch_infer(str(tiny_model), str(corpus / "a.jsonl"), str(out_dir))
    batch_infer(str(tiny_model), str(corpus / "c.parquet"), str(out_dir), id_column="doc")
    table = pq.read_table(out_dir).to_pandas()
    assert sorted(table["id"]) == sorted(f"d{i}" for i in range(100))


def test_missing_input_is_refused_before_ray(tiny_model, tmp_path):
    with pytest.raises(DataError, match="no input files found"):
        batch_infer(str(tiny_model), str(tmp_path / "nowhere" / "*.jsonl"), str(tmp_path / "out"))
