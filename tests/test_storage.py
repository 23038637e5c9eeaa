"""Storage: what ftflow writes is read whole or not at all, and never lands on an input or a file."""

from __future__ import annotations

import json
import threading

import pytest
from conftest import alongside, free_port

from tasks.core import layout, storage


def test_a_reader_never_sees_a_json_file_half_written(tmp_path):
    """Markers and manifests say a result is complete: a reader racing a rewrite sees the old file
    or the new one, never part of one, and nothing is left beside it."""
    target = tmp_path / "runs" / "r1" / "manifest.json"
    big = {"rows": list(range(200_000))}  # ~1.6 MB: a non-atomic write would be caught in the middle
    storage.write_json(str(target), big)
    torn = []

    def read_until_done(done: threading.Event) -> None:
        while not done.is_set():
            try:
                json.loads(target.read_bytes())
            except json.JSONDecodeError as error:
                torn.append(error)

    with alongside(read_until_done):
        for version in range(30):
            storage.write_json(str(target), big | {"version": version})
    assert not torn, f"{len(torn)} reads saw a partly written file"
    assert storage.read_json(str(target))["version"] == 29
    assert [p.name for p in target.parent.iterdir()] == ["manifest.json"]


def test_overlap_is_by_whole_path_segments(tmp_path):
    """corpus2/ is apart from corpus/; a folder, a file, a prefix on S3 are compared alike."""
    cases = {
        (f"{tmp_path}/corpus", f"{tmp_path}/corpus"): "is the input",
        (f"{tmp_path}/corpus/out", f"{tmp_path}/corpus"): "is inside the input",
        (f"{tmp_path}", f"{tmp_path}/corpus/a.jsonl"): "holds the input",
        ("s3://bucket/corpus/", "s3://bucket/corpus/a.jsonl"): "holds the input",
    }
    for (output, input_), how in cases.items():
        with pytest.raises(layout.UnsafeOutput, match=how):
            layout.refuse_overlap([output], [input_])
    layout.refuse_overlap([f"{tmp_path}/corpus2", "s3://bucket/corpus2"], [f"{tmp_path}/corpus", "s3://bucket/corpus"])
    layout.refuse_overlap([f"{tmp_path}/corpus"], ["s3://bucket" + str(tmp_path) + "/corpus"])


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "labels.parquet").write_bytes(b"the user's")
    with pytest.raises(layout.UnsafeOutput, match="labels.parquet is a file"):
        layout.OutputFolder(str(tmp_path / "labels.parquet")).check()
    assert (tmp_path / "labels.parquet").read_bytes() == b"the user's"


def test_an_object_store_that_cannot_be_reached_is_said_plainly(monkeypatch):
    """Not "bucket does not exist" (s3fs's exists() is False for a store it cannot reach too)."""
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with pytest.raises(
        ValueError,
        match=f"^storage_root s3://somewhere/ftflow: the object store cannot be reached: "
        f'Could not connect to the endpoint URL: "{endpoint}/somewhere"$',
    ):
        storage.check_writable("s3://somewhere/ftflow", "storage_root")
