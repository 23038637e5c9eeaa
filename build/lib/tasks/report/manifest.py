"""The run manifest: everything needed to reproduce a run, written last so that its presence
marks a complete run."""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from importlib.metadata import version

from prefect import task

from tasks.core import storage
from tasks.core.retries import RETRY_TRANSIENT

PACKAGES = ("torch", "transformers", "tokenizers", "deepspeed", "ray", "prefect", "pyarrow", "fsspec", "s3fs")


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), **{name: version(name) for name in PACKAGES}}


@task(**RETRY_TRANSIENT)
def write_manifest(
    manifest_uri: str, config: dict, cluster: dict, data: dict, outputs: dict, metrics: dict, seconds: dict
) -> str:
    storage.write_json(
        manifest_uri,
        {
            "completed_at": datetime.now(UTC).isoformat(),
            "config": config,
            "versions": versions(),
            "cluster": cluster,  # the one that trained
            "data": data,
            "outputs": outputs,
            "metrics": metrics,
            "seconds": seconds,  # wall time per stage
        },
    )
    return manifest_uri
