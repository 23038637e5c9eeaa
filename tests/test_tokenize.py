"""Tokenize: Parquet shards in storage, reused for the same content wherever the files live."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import read_jsonl
from prefect import flow, get_client, get_run_logger
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler
from test_data import mixed_split
from test_flow import params

from flows.finetune import prepared
from tasks.contracts.shards import TokenizedSplits
from tasks.contracts.training import TrainingJob
from tasks.core import cluster, files, layout, storage
from tasks.core.cluster import Resources
from tasks.core.config import DataConfig, FinetuneParams
from tasks.core.data import load_splits
from tasks.core.layout import CLAIM, MARKER, RunStore
from tasks.core.text import encoded, truncating
from tasks.report import Stopwatch
from tasks.tokenize.driver import load_tokenizer, tokenize_key
from tasks.tokenize.task import tokenize


def splits_in(folder, small_data):
    folder.mkdir()
    paths = {name: str(shutil.copy(path, folder / path.name)) for name, path in small_data.items()}
    return load_splits(DataConfig(train_uri=paths["train"], validation_uri=paths["validation"], test_uri=paths["test"]))


def test_same_content_elsewhere_hits_the_cache(ray_cluster, tiny_model, small_data, tmp_path):
    root, model = str(tmp_path / "store"), str(tiny_model)
    first, moved = splits_in(tmp_path / "a", small_data), splits_in(tmp_path / "b", small_data)

    @flow
    def tokenize_three_times():
        return [
            tokenize(tokenize_key(first, model, 48, root), first, model, return_state=True),
            tokenize(tokenize_key(moved, model, 48, root), moved, model, return_state=True),
            tokenize(tokenize_key(moved, model, 16, root), moved, model, return_state=True),
        ]

    original, same_content, shorter = tokenize_three_times()
    assert original.name == "Completed" and same_content.name == "Cached" and shorter.name == "Completed"
    assert same_content.result() == original.result()
    assert shorter.result().train != original.result().train

    labels = [row["label"] for row in read_jsonl(small_data["train"])]
    for uris, max_length in ((original.result(), 48), (shorter.result(), 16)):
        table = pq.read_table(uris.train)
        assert sorted(table["row"].to_pylist()) == list(range(len(labels)))
        assert table["label"].to_pylist() == [labels[r] for r in table["row"].to_pylist()]
        assert max(len(ids) for ids in table["input_ids"].to_pylist()) == max_length


def test_the_key_follows_the_tokenizer_files_not_the_model_folder(tiny_model, small_data, tmp_path):
    """Read without transformers (tasks/core/models.py): a copy of the model elsewhere keys the same
    shards, and a change to its tokenizer's files other ones."""
    splits, copy = splits_in(tmp_path / "data", small_data), shutil.copytree(tiny_model, tmp_path / "copy")

    def digest(model: Path) -> str:
        return tokenize_key(splits, str(model), 32, str(tmp_path / "store")).digest

    assert digest(copy) == digest(tiny_model)
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps(settings | {"do_lower_case": False}))
    assert digest(copy) != digest(tiny_model)


def test_split_of_many_files_tokenizes_exactly_its_rows(
    ray_cluster, tiny_model, small_data, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(files, "PIECE_BYTES", 500)  # the JSONL file and the Parquet file in pieces too
    caplog.set_level(logging.INFO, logger="ftflow")
    inputs, expected = mixed_split(tmp_path / "data", read_jsonl(small_data["train"]))
    splits = load_splits(
        DataConfig(train_uri=inputs, validation_uri=[str(small_data["validation"])], test_uri=str(small_data["test"]))
    )
    tokenizer = load_tokenizer(str(tiny_model))
    key = tokenize_key(splits, str(tiny_model), 32, str(tmp_path / "store"))
    uris = tokenize.with_options(refresh_cache=True)(key, splits, str(tiny_model))  # a fresh write, whatever ran before

    table = pq.read_table(uris.train).sort_by("row")
    assert table["row"].to_pylist() == list(range(len(expected)))
    assert table["label"].to_pylist() == expected["label"].tolist()
    assert (
        table["input_ids"].to_pylist()
        == tokenizer(expected["text"].tolist(), truncation=True, max_length=32)["input_ids"]
    )
    assert len(splits["train"].pieces) > 4
    cpus = int(Resources.of_cluster().cpus)  # the CPUs ftflow's stages may take (one is Ray Data's)
    assert len(list(Path(uris.train).glob("*.parquet"))) == cpus, "the pieces shared out, a task per CPU"
    # The shard tasks' tallies, summed by the driver: the last tick counts every row of every split.
    rows, shards = sum(split.total_rows for split in splits.values()), 3 * cpus
    ticks = [record.message for record in caplog.records if record.message.startswith("tokenize: ")]
    assert ticks[-1] == f"tokenize: {rows:,} / {rows:,} rows, {shards}/{shards} shards", ticks


def test_an_interrupted_attempt_is_replaced_and_complete_shards_reused(ray_cluster, tiny_model, small_data, tmp_path):
    splits = splits_in(tmp_path / "data", small_data)
    key = tokenize_key(splits, str(tiny_model), 32, str(tmp_path / "store"))

    @flow
    def tokenize_as_finetune_does():  # flows/finetune.py: the cache is trusted only where the marker is
        return tokenize.with_options(refresh_cache=not key.shards_exist())(
            key, splits, str(tiny_model), return_state=True
        )

    # A file changed after it was checked: the attempt fails mid-write, leaving its claim, no marker.
    test_file = Path(splits["test"].uris[0])
    checked = test_file.read_bytes()
    test_file.write_bytes(checked.replace(b'"label": 1}', b'"label": 7}', 1))
    with pytest.raises(Exception, match="labels outside"):
        tokenize_as_finetune_does()
    assert storage.exists(storage.join(key.target, CLAIM)) and not key.shards_exist()

    test_file.write_bytes(checked)
    again = tokenize_as_finetune_does()
    assert again.name == "Completed" and key.shards_exist()
    marker = storage.read_json(storage.join(key.target, MARKER))
    assert marker["rows"] == {"train": 2048, "validation": 128, "test": 128}
    assert layout.OutputFolder(key.target).files() == {*marker["files"], MARKER}, "the failed attempt's files are gone"
    assert pq.read_table(again.result().test).num_rows == 128
    assert tokenize_as_finetune_does().name == "Cached"

    # A machine whose Prefect cache lacks the key finds the complete shards: reused, not rewritten.
    stamps = {f: (Path(key.target) / f).stat().st_mtime_ns for f in marker["files"]}

    @flow
    def tokenize_without_the_cache_entry():
        return tokenize.with_options(refresh_cache=True)(key, splits, str(tiny_model))

    assert tokenize_without_the_cache_entry() == again.result()
    assert {
        f: (Path(key.target) / f).stat().st_mtime_ns for f in layout.OutputFolder(key.target).files() - {MARKER}
    } == stamps


def prefect_messages(flow_run_id) -> list[str]:
    APILogHandler().flush()  # log records are shipped in the background
    with get_client(sync_client=True) as client:
        return [
            log.message
            for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        ]


def test_two_runs_started_at_once_on_the_same_data_write_one_shard_set_and_both_training_jobs_take_it(
    ray_cluster, tiny_model, small_data, tmp_path, monkeypatch
):
    """Each run as `finetune` prepares one (flows/finetune.py's `prepared`: its checks, the plan, then
    tokenize), up to the training job it would start: both jobs take the one shard set. (Training on
    a job's shards is every other run's test: the two trainings were 27 s of this test's 34 in CI, 7 s without)"""
    root = str(tmp_path / "store")
    runs = [params(tiny_model, small_data, root).model_copy(update={"run_id": run_id}) for run_id in ("a", "b")]
    # Both runs have checked their inputs, and found no shards, before either starts tokenizing.
    both_checked, refuse_local_paths = threading.Barrier(2), cluster.refuse_local_paths

    def checked_together(*args):
        both_checked.wait(60)
        refuse_local_paths(*args)

    monkeypatch.setattr(cluster, "refuse_local_paths", checked_together)

    @flow
    def prepared_as_finetune_does(run: FinetuneParams) -> TrainingJob:
        return prepared(run, RunStore(run.storage_root, run.run_id), Stopwatch(get_run_logger())).job

    with ThreadPoolExecutor(2) as pool:
        states = list(pool.map(lambda run: prepared_as_finetune_does(run, return_state=True), runs))

    jobs = [state.result() for state in states]
    assert [job.store.run_id for job in jobs] == ["a", "b"]
    messages = [message for state in states for message in prefect_messages(state.state_details.flow_run_id)]
    assert sum(message.startswith("tokenized {") for message in messages) == 1, "the shard set was written twice"
    assert sum(message.startswith("using the tokenized shards at") for message in messages) == 1
    [shard_set] = [path for path in (tmp_path / "store" / "tokenized").iterdir()]
    marker = storage.read_json(str(shard_set / MARKER))
    assert layout.OutputFolder(str(shard_set)).files() == {*marker["files"], MARKER}, "one whole set, nothing else"
    for job in jobs:
        assert job.shards == TokenizedSplits(
            **{name: str(shard_set / name) for name in ("train", "validation", "test")}
        )
        assert job.shards.rows() == marker["rows"]


@pytest.mark.parametrize(
    "given, message",
    [
        ("{tmp}/nowhere", "model.name_or_path {tmp}/nowhere: no such folder"),
        ("{tmp}", "model.name_or_path {tmp}: a folder without config.json, not a saved Hugging Face model"),
        (
            "ftflow-test/not-a-model",
            "model.name_or_path ftflow-test/not-a-model: not a folder here, and the Hugging Face hub does "
            "not resolve it (HF_HUB_OFFLINE is set: nothing is downloaded): ",
        ),
    ],
)
def test_a_model_that_is_not_there_is_said_plainly(tmp_path, given, message):
    with pytest.raises(ValueError) as refused:
        load_tokenizer(given.format(tmp=tmp_path))
    assert str(refused.value).startswith(message.format(tmp=tmp_path))


@pytest.mark.parametrize(("side", "whole"), [("only_second", 0), ("only_first", 1)])
def test_a_pair_is_two_segments_truncated_on_the_side_asked(tiny_model, side, whole):
    """The other text keeps every token; longest_first (the default) takes from the longer one first."""
    tokenizer = load_tokenizer(str(tiny_model))
    texts = ["a fine film with a fine cast " * 6, "dull " * 40]
    alone = [len(tokenizer(text)["input_ids"]) - 2 for text in texts]  # without [CLS] and [SEP]
    ids, types = encoded(truncating(tokenizer, 48, side), [texts[0]], [texts[1]])
    assert len(ids[0]) == 48 and types[0].count(whole) == alone[whole] + (2 if whole == 0 else 1)
    _, [balanced] = encoded(truncating(tokenizer, 48), [texts[0]], [texts[1]])
    assert abs(balanced.count(0) - 1 - balanced.count(1)) <= 1, "longest_first trims both to about the same length"
