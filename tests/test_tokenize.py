"""Tokenize: Parquet shards in storage, reused for the same content wherever the files live."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
from prefect import flow

from tasks.config import DataConfig
from tasks.data import load_splits
from tasks.tokenize import load_tokenizer, tokenize, tokenize_key


def splits_in(folder, small_data):
    folder.mkdir()
    paths = {name: str(shutil.copy(path, folder / path.name)) for name, path in small_data.items()}
    return load_splits(DataConfig(train_uri=paths["train"], validation_uri=paths["validation"], test_uri=paths["test"]))


def test_same_content_elsewhere_hits_the_cache(ray_cluster, tiny_model, small_data, tmp_path):
    root, tokenizer = str(tmp_path / "store"), load_tokenizer(str(tiny_model))
    first, moved = splits_in(tmp_path / "a", small_data), splits_in(tmp_path / "b", small_data)

    @flow
    def tokenize_three_times():
        return [
            tokenize(tokenize_key(first, tokenizer, 48, root), first, str(tiny_model), return_state=True),
            tokenize(tokenize_key(moved, tokenizer, 48, root), moved, str(tiny_model), return_state=True),
            tokenize(tokenize_key(moved, tokenizer, 16, root), moved, str(tiny_model), return_state=True),
        ]

    original, same_content, shorter = tokenize_three_times()
    assert original.name == "Completed" and same_content.name == "Cached" and shorter.name == "Completed"
    assert same_content.result() == original.result()
    assert shorter.result()["train"] != original.result()["train"]

    for uris, max_length in ((original.result(), 48), (shorter.result(), 16)):
        table = pq.read_table(uris["train"])
        assert sorted(table["row"].to_pylist()) == list(range(len(first["train"].texts)))
        assert table["label"].to_pylist() == [first["train"].labels[r] for r in table["row"].to_pylist()]
        assert max(len(ids) for ids in table["input_ids"].to_pylist()) == max_length
