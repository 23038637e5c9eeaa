"""ftflow's storage, local or S3-compatible, through fsspec: reading, writing, hashing and
listing files, the one way every stage does (where ftflow writes is tasks/core/layout.py).

S3 endpoint and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)
as boto reads them; they are never copied into a path, a log line or an artifact.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.fs
from botocore.exceptions import BotoCoreError, NoCredentialsError


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


def check_writable(uri: str, what: str) -> None:
    """Refuse, before any work, a place ftflow cannot write: a bucket that does not exist (s3fs
    creates one on the first write), or that this machine's credentials cannot write to; a folder
    under which nothing can be made. The probe is an empty object or folder of ftflow's own, removed
    at once: permissions alone do not tell (root may write anywhere, yet /proc takes no folder)."""
    if not is_remote(uri):
        existing = Path(normalize(uri))
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{what} {uri}: {existing} is a file, not a folder")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".ftflow-probe-", dir=existing))
        except OSError as error:
            raise ValueError(f"{what} {uri}: nothing can be written under {existing}: {error.strerror}") from None
        return
    fs, path = filesystem(uri)
    bucket = path.split("/")[0]
    try:
        fs.call_s3("head_bucket", Bucket=bucket)  # s3fs's exists() says False for a store it cannot reach too
    except FileNotFoundError:
        raise ValueError(
            f"{what} {uri}: bucket '{bucket}' does not exist; ftflow creates no buckets: create it or fix the name"
        ) from None
    except NoCredentialsError:
        raise ValueError(
            f"{what} {uri}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE, or give this machine a role"
        ) from None
    except PermissionError as error:
        raise ValueError(f"{what} {uri}: this machine's credentials may not use bucket '{bucket}': {error}") from None
    except (BotoCoreError, OSError) as error:  # no connection, DNS, TLS: botocore's words name the endpoint
        raise ValueError(f"{what} {uri}: the object store cannot be reached: {error}") from None
    probe = f"{path.rstrip('/')}/.ftflow-probe-{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except OSError as error:
        raise ValueError(f"{what} {uri}: not writable with this machine's credentials: {error}") from None


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


def read_versioned_json(uri: str) -> tuple[Any | None, str | None]:
    """(content, version) of a small JSON object, or (None, None) where there is none. The version
    is what swap_json compares: the object's ETag on S3 (s3fs reads with If-Match that ETag, so content
    and version agree), the content's sha256 locally."""
    fs, path = filesystem(uri)
    fs.invalidate_cache(path)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
            version = f.details["ETag"] if is_remote(uri) else hashlib.sha256(data).hexdigest()
    except FileNotFoundError:
        return None, None
    return json.loads(data), version


def swap_json(uri: str, version: str | None, payload: Any) -> bool:
    """Compare-and-swap: write payload only if the object is still at `version` (None: still absent);
    False, with nothing written, when another writer got there first. On S3 the store decides, in one
    conditional PUT (If-Match / If-None-Match, which AWS S3, MinIO and moto honour); locally an
    exclusive flock on a lock file of ftflow's own beside it serialises compare and write, on one
    machine (or NFS with working locks)."""
    data = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
    fs, path = filesystem(uri)
    if is_remote(uri):
        condition = {"IfMatch": version} if version else {"mode": "create"}
        try:
            fs.pipe_file(path, data, **condition)
        except FileExistsError:
            return False
        except OSError as error:  # s3fs makes an If-Match miss (HTTP 412) an OSError; its cause names it
            if "PreconditionFailed" in str(error.__cause__):
                return False
            raise
        return True
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if read_versioned_json(uri)[1] != version:
            return False
        write_bytes(uri, data)
        return True


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


def move_dir(local_dir: str | Path, uri: str) -> None:
    """A finished local folder's files into storage: uploaded to S3; on this machine moved (renamed on
    one filesystem, not copied: a 5B-parameter model exported in fp32 is 20 GB, which a copy wrote twice
    and held twice on the disk)."""
    fs, path = filesystem(uri)
    fs.makedirs(path, exist_ok=True)
    for file in sorted(Path(local_dir).rglob("*")):
        if file.is_file():
            target = join(path, file.relative_to(local_dir).as_posix())
            if is_remote(uri):
                fs.put_file(str(file), target)
            else:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(file, target)


def download_dir(uri: str, local_dir: str | Path) -> Path:
    fs, path = filesystem(uri)
    local_dir = Path(local_dir)
    for remote in fs.find(path):
        target = local_dir / remote[len(path.rstrip("/")) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
    return local_dir


def copy_dir(uri: str, to: str) -> None:
    """Every file under uri to the same place under `to`, file by file (on S3 each a server-side
    copy); both on one filesystem, as a root's folders are."""
    fs, path = filesystem(uri)
    _, target = filesystem(to)
    fs.makedirs(target, exist_ok=True)
    for source in fs.find(path):
        fs.copy(source, join(target, source[len(path.rstrip("/")) + 1 :]))


def pyarrow_filesystem(uri: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """(path, filesystem) for Ray Train's RunConfig and Ray Data, sharing fsspec's S3 settings."""
    if not is_remote(uri):
        return normalize(uri), None
    fs, path = filesystem(uri)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))
