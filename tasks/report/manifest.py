"""The run manifest: everything needed to reproduce a run, written last so that its presence
marks a complete run."""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from importlib.metadata import version

from prefect import task
from pydantic import BaseModel

from tasks.contracts.labels import Labelled
from tasks.contracts.metrics import AnyMetrics
from tasks.contracts.promotion import Decision
from tasks.contracts.shards import TokenizedSplits
from tasks.contracts.sweep import SweepResult
from tasks.contracts.training import Result
from tasks.core import storage
from tasks.core.data import Split
from tasks.prefect_side.retries import RETRY_TRANSIENT

PACKAGES = ("torch", "transformers", "tokenizers", "deepspeed", "ray", "prefect", "pyarrow", "fsspec", "s3fs")


class Outputs(BaseModel):
    """Where a run's artifacts are."""

    tokenized: TokenizedSplits
    checkpoints: str
    model: str
    adapter: str | None  # a LoRA run's adapter alone, beside the merged model
    metrics: str
    predictions: Labelled
    report: str
    manifest: str


class Results(BaseModel):
    """What a run's stages returned, as its report, manifest and MLflow run read it."""

    test: AnyMetrics
    training: Result
    promotion: Decision
    sweep: SweepResult | None = None  # a sweep's trials; training is its best trial's

    def recorded(self) -> dict:
        """As the manifest holds them: the training's history, curve, nodes, worker groups, strategy, why it stopped,
        which step it kept and its parameters (all, and trained), not its predictions; a sweep's trials."""
        return self.model_dump(
            mode="json",
            include={
                "test": True,
                "promotion": True,
                "training": {
                    "history",
                    "curve",
                    "nodes",
                    "groups",
                    "strategy",
                    "stopped",
                    "kept",
                    "parameters",
                    "trained_parameters",
                },
                "sweep": {
                    "metric",
                    "direction",
                    "fields",
                    "space",
                    "rungs",
                    "trials",
                    "best_trial",
                },  # its best's Result is training
            },
        )


class SplitRecord(BaseModel):
    uris: list[str]
    sha256: str
    rows: int
    windows: int | None = None  # token_classification: its texts' windows (a long one takes several)


class DataRecord(BaseModel):
    """The data a run read: each split's files, content hash and rows, and its tokenized shards' key."""

    splits: dict[str, SplitRecord]
    tokenize_key: dict

    @classmethod
    def of(cls, splits: dict[str, Split], tokenize_key: BaseModel, tokenized: TokenizedSplits) -> DataRecord:
        windows = tokenized.rows() if splits["train"].schema.tagged else {}
        return cls(
            splits={
                name: SplitRecord(
                    uris=list(split.uris), sha256=split.sha256, rows=split.total_rows, windows=windows.get(name)
                )
                for name, split in splits.items()
            },
            tokenize_key=tokenize_key.model_dump(),
        )


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), **{name: version(name) for name in PACKAGES}}


@task(**RETRY_TRANSIENT)
def write_manifest(
    manifest_uri: str, config: dict, data: DataRecord, outputs: Outputs, results: Results, seconds: dict
) -> str:
    storage.write_json(
        manifest_uri,
        {
            "completed_at": datetime.now(UTC).isoformat(),
            "config": config,
            "versions": versions(),
            "cluster": results.training.cluster.model_dump()
            if results.training.cluster
            else None,  # the one that trained
            "data": data.model_dump(),
            "outputs": outputs.model_dump(mode="json"),
            "metrics": results.recorded(),
            "seconds": seconds,  # wall time per stage
        },
    )
    return manifest_uri
