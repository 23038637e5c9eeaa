"""What names a model: a saved Hugging Face model's folder (local or remote) or a hub id, checked in
one line naming the field, and from_pretrained's arguments that keep a folder off the hub."""

from __future__ import annotations

from pathlib import Path

from tasks.core import storage


def hub_free(name_or_path: str) -> dict:
    """from_pretrained's arguments that keep it off the model hub for a folder or a path (the CLI and
    the deployments do not set HF_HUB_OFFLINE): where packets are dropped, a hub question waits ~10 s.
    transformers 5.23 asks nothing about an existing folder even without this (measured: no
    connection); it keeps that so across versions, and a path missing on a node fails at once."""
    path = Path(name_or_path).expanduser()
    return {"local_files_only": True} if "://" in name_or_path or path.is_absolute() or path.is_dir() else {}


def saved_model(uri: str, field: str) -> str:
    """uri, a saved Hugging Face model's folder (local or remote), as every node reads it: a local
    one made absolute (Ray's workers run in folders of their own). Else one line naming the field."""
    remote = storage.is_remote(uri)
    if not (storage.exists(uri) if remote else Path(uri).expanduser().is_dir()):
        raise ValueError(f"{field} {uri}: no such folder")
    if not storage.exists(storage.join(uri, "config.json")):
        raise ValueError(f"{field} {uri}: a folder without config.json, not a saved Hugging Face model")
    return uri if remote else str(Path(uri).expanduser().resolve())


def training_model(name_or_path: str) -> None:
    """model.name_or_path: a hub id (transformers resolves it when tokenizing: tasks/tokenize/), or
    what names a folder (a path, not 'org/name') must be a saved model's."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        saved_model(name_or_path, "model.name_or_path")
