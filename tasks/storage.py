"""The one owner of ftflow's storage layout, local or S3-compatible, through fsspec.

    <root>/tokenized/<content-key>/<split>/*.parquet   shared by every run with the same content
    <root>/runs/<run_id>/train/                        Ray Train checkpoints
    <root>/runs/<run_id>/model/                        consolidated Hugging Face model folder
    <root>/runs/<run_id>/metrics.json
    <root>/runs/<run_id>/predictions/*.parquet, _SUCCESS.json written last: no marker, no result
    <root>/runs/<run_id>/report/report.md, *.png       the run report and its plots
    <root>/runs/<run_id>/manifest.json                 written last: no manifest, no result
    <root>/models/<name>/champion                      the promoted model's URI, replaced in one write

S3 endpoint and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)
as boto reads them; they are never copied into a path, a log line or an artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.fs


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def normalize(uri: str) -> str:
    """Absolute local paths, untouched URIs: the form stored in manifests and passed to workers."""
    return uri.rstrip("/") if is_remote(uri) else str(Path(uri.removeprefix("file://")).expanduser().resolve())


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    options = {}
    if uri.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        # s3fs does not read AWS_ENDPOINT_URL itself; S3-compatible stores (MinIO, moto) need it.
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return fsspec.core.url_to_fs(uri, **options)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def write_bytes(uri: str, data: bytes) -> None:
    """Write a file that readers see whole, old or new, never in part (a run's markers and manifest
    say it is complete, so a crash must not leave half of one): a local file is written aside and
    renamed over the target (atomic on POSIX); an object store replaces an object in one PUT."""
    fs, path = filesystem(uri)
    if is_remote(uri):
        fs.pipe_file(path, data)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    aside = target.with_name(f".{target.name}.{uuid.uuid4().hex}")  # unique: concurrent writers never share one
    aside.write_bytes(data)
    os.replace(aside, target)


def write_json(uri: str, payload: Any) -> None:
    """Indented, keys sorted, anything else as its str(); whole or not at all (write_bytes)."""
    write_bytes(uri, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


def read_json(uri: str) -> Any:
    fs, path = filesystem(uri)
    with fs.open(path) as f:
        return json.load(f)


def sha256(uri: str) -> str:
    fs, path = filesystem(uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Written last into an output folder (tokenized shards, predictions), so a reader can tell a complete
# result from the remains of a failed or interrupted job; Parquet readers skip "_" files.
MARKER = "_SUCCESS.json"


def clear_marked(uri: str) -> None:
    """Remove an output folder completed by a MARKER: the marker goes first, so no reader ever sees
    it beside a half-deleted output."""
    fs, path = filesystem(uri)
    marker_path = filesystem(join(uri, MARKER))[1]
    if fs.exists(marker_path):
        fs.rm(marker_path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def size(uri: str) -> int:
    fs, path = filesystem(uri)
    return fs.size(path)


def fingerprint(uri: str) -> str:
    """A cheap identity of a file's or folder's current content: fsspec's ukey (the ETag and
    modification time on S3, size and mtime locally) of every file. Hashing every byte of a corpus
    would read it a second time."""
    fs, path = filesystem(uri)
    files = sorted(fs.find(path)) if fs.isdir(path) else [path]
    return hashlib.sha256("".join(f"{os.path.relpath(f, path)}={fs.ukey(f)};" for f in files).encode()).hexdigest()


def upload_dir(local_dir: str | Path, uri: str) -> None:
    fs, path = filesystem(uri)
    fs.makedirs(path, exist_ok=True)
    for file in sorted(Path(local_dir).rglob("*")):
        if file.is_file():
            fs.put_file(str(file), join(path, file.relative_to(local_dir).as_posix()))


def download_dir(uri: str, local_dir: str | Path) -> Path:
    fs, path = filesystem(uri)
    local_dir = Path(local_dir)
    for remote in fs.find(path):
        target = local_dir / remote[len(path.rstrip("/")) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
    return local_dir


def pyarrow_filesystem(uri: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """(path, filesystem) for Ray Train's RunConfig and Ray Data, sharing fsspec's S3 settings."""
    if not is_remote(uri):
        return normalize(uri), None
    fs, path = filesystem(uri)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


@dataclass(frozen=True)
class RunStore:
    root: str
    run_id: str

    @property
    def base(self) -> str:
        return join(normalize(self.root), "runs", self.run_id)

    @property
    def train_dir(self) -> str:
        return join(self.base, "train")

    @property
    def model_dir(self) -> str:
        return join(self.base, "model")

    @property
    def metrics(self) -> str:
        return join(self.base, "metrics.json")

    @property
    def predictions(self) -> str:
        return join(self.base, "predictions")

    @property
    def report(self) -> str:
        return join(self.base, "report")

    @property
    def manifest(self) -> str:
        return join(self.base, "manifest.json")

    def tokenized(self, content_key: str) -> str:
        return join(normalize(self.root), "tokenized", content_key)
