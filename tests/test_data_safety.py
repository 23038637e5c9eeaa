"""ftflow deletes only what it wrote, never writes where it reads, and keeps names inside its folders.
Every hazard test snapshots every byte that was there before and requires all of it afterwards."""

from __future__ import annotations

import shutil
import uuid

import pyarrow.parquet as pq
import pytest
from conftest import BUCKET, cpus_freed, run_batch_infer
from pydantic import ValidationError
from test_flow import params

from flows.finetune import finetune
from tasks.core import storage
from tasks.core.config import FinetuneParams
from tasks.core.layout import CLAIM, MARKER, RunStore, UnsafeOutput


class Place:
    """A folder on local disk or under a moto S3 prefix, where a user keeps their own files."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fs, self.path = storage.filesystem(root)

    def uri(self, name: str = "") -> str:
        return storage.join(self.root, name) if name else self.root

    def write(self, name: str, data: bytes) -> str:
        storage.write_bytes(self.uri(name), data)
        return self.uri(name)

    def snapshot(self) -> dict[str, bytes]:
        self.fs.invalidate_cache(self.path)
        return {found: self.fs.cat_file(found) for found in self.fs.find(self.path)}


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path) -> Place:
    if request.param == "local":
        return Place(str(tmp_path / "user"))
    request.getfixturevalue("s3_endpoint")
    return Place(f"s3://{BUCKET}/user-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def corpus(place) -> Place:
    """The issue's reproduction: corpus/ holds the reviews to label and the user's own notes."""
    place.write("corpus/reviews.jsonl", b'{"text": "a fine film"}\n{"text": "a dull one"}\n')
    place.write("corpus/NOTES.txt", b"my notes, not ftflow's\n")
    return place


def refused(place: Place, model: str, inputs: str, output: str, match: str) -> None:
    before = place.snapshot()
    with pytest.raises(UnsafeOutput, match=match):
        run_batch_infer(model, inputs, output)
    assert place.snapshot() == before, "a refused job changed the user's files"


def test_output_in_the_inputs_folder_is_refused_and_nothing_is_touched(corpus, tiny_model):
    reviews = corpus.uri("corpus/reviews.jsonl")
    refused(
        corpus,
        str(tiny_model),
        reviews,
        corpus.uri("corpus"),
        f"output {corpus.uri('corpus')} holds the input {reviews}: ftflow never writes where it reads",
    )


def test_output_holding_the_input_further_down_is_refused(corpus, tiny_model):
    reviews = corpus.uri("corpus/reviews.jsonl")
    refused(corpus, str(tiny_model), reviews, corpus.uri(), f"output {corpus.uri()} holds the input {reviews}")


def test_output_inside_an_input_folder_is_refused(corpus, tiny_model):
    refused(
        corpus,
        str(tiny_model),
        corpus.uri("corpus"),
        corpus.uri("corpus/labels"),
        f"output {corpus.uri('corpus/labels')} is inside the input {corpus.uri('corpus')}",
    )


def test_output_folder_holding_someone_elses_files_is_refused(corpus, tiny_model):
    corpus.write("labels/README.md", b"a folder the user keeps their own labels in\n")
    refused(
        corpus,
        str(tiny_model),
        corpus.uri("corpus/reviews.jsonl"),
        corpus.uri("labels"),
        f"output {corpus.uri('labels')} holds {corpus.uri('labels/README.md')}, which ftflow did not write",
    )


def test_a_rerun_replaces_exactly_its_own_earlier_output(ray_cluster, tiny_model, tmp_path):
    user = Place(str(tmp_path))
    user.write("corpus/a.jsonl", b"".join(b'{"text": "film %d was good"}\n' % i for i in range(300)))
    user.write("corpus/b.jsonl", b"".join(b'{"text": "plot %d bored me"}\n' % i for i in range(100)))
    user.write("NOTES.txt", b"beside the output, the user's own\n")
    out = Place(user.uri("labels"))
    run_batch_infer(str(tiny_model), user.uri("corpus/a.jsonl"), out.uri())
    first = set(out.snapshot())
    theirs = {name: data for name, data in user.snapshot().items() if name not in first}

    run_batch_infer(str(tiny_model), user.uri("corpus/b.jsonl"), out.uri())
    marker = storage.read_json(out.uri(MARKER))
    now = out.snapshot()
    assert set(now) == {out.uri(name) for name in [*marker["files"], MARKER]}, "only the new job's files and marker"
    assert not first & set(now) - {out.uri(MARKER)}, "every file of the earlier job was replaced"
    assert sorted(pq.read_table(out.path).column("id").to_pylist()) == sorted(f"b.jsonl:{i}" for i in range(100))
    assert {name: data for name, data in user.snapshot().items() if name in theirs} == theirs


def test_a_failed_jobs_remains_are_replaced_by_the_next_one(ray_cluster, tiny_model, tmp_path):
    """A job that fails mid-write leaves its claim and part of its files, no marker: they are
    ftflow's on the record, so the next job removes them and nothing else."""
    user = Place(str(tmp_path))
    # Its first line passes the check before the job; the job fails on the line after, mid-write.
    # Labelled first, it fails while parts of the next file are in flight, whose actor Ray Data
    # leaves to the garbage collector.
    user.write("corpus/0.jsonl", b'{"text": "a fine film"}\n{"text": "cut off\n')
    user.write("corpus/a.jsonl", b"".join(b'{"text": "film %d was good"}\n' % i for i in range(3000)))
    out = Place(user.uri("labels"))
    with pytest.raises(Exception, match="0.jsonl: cannot be read as jsonl"):
        run_batch_infer(str(tiny_model), user.uri("corpus"), out.uri(), actors=2)
    assert CLAIM in {name.rsplit("/", 1)[-1] for name in out.snapshot()} and not storage.exists(out.uri(MARKER))
    cpus_freed(ray_cluster, 10, "the failed job's actors")

    run_batch_infer(str(tiny_model), user.uri("corpus/a.jsonl"), out.uri(), wait_for_actors_s=60)
    marker = storage.read_json(out.uri(MARKER))
    assert set(out.snapshot()) == {out.uri(name) for name in [*marker["files"], MARKER]}
    assert marker["rows"] == 3000 == pq.read_table(out.path).num_rows


def test_a_run_folder_holding_someone_elses_files_is_refused(tiny_model, small_data, tmp_path):
    user = Place(str(tmp_path / "store"))
    user.write("runs/mine/thesis.tex", b"not ftflow's\n")
    before = user.snapshot()
    run = params(tiny_model, small_data, user.uri()).model_copy(update={"run_id": "mine"})
    with pytest.raises(
        UnsafeOutput, match=f"run folder {user.uri('runs/mine')} holds {user.uri('runs/mine/thesis.tex')}"
    ):
        finetune(run)
    assert user.snapshot() == before


def test_a_run_never_writes_over_the_model_it_reads(tiny_model, small_data, tmp_path):
    store = RunStore(str(tmp_path / "store"), "again")
    run = params(tiny_model, small_data, store.root).model_copy(update={"run_id": "again"})
    shutil.copytree(tiny_model, store.model_dir)  # a model from an earlier attempt of the same run id
    run.model.name_or_path = store.model_dir
    with pytest.raises(UnsafeOutput, match=f"output {store.base} holds the input {store.model_dir}"):
        finetune(run)


def test_names_that_would_leave_their_folder_are_refused(tmp_path):
    for name in ["../..", "..", "/etc", "a/b", ".hidden", "", "x" * 129]:
        with pytest.raises(ValidationError, match="run_id\n.*it names a folder in storage"):
            FinetuneParams(run_id=name)
        with pytest.raises(ValidationError, match="model_name\n.*it names a folder in storage"):
            FinetuneParams.model_validate({"promotion": {"model_name": name}})
        with pytest.raises(UnsafeOutput, match="run_id"):
            RunStore(str(tmp_path), name)
    with pytest.raises(UnsafeOutput, match="model name '..'"):
        run_batch_infer("models/..@champion", str(tmp_path), str(tmp_path / "out"))
