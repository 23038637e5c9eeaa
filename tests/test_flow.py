"""The whole `finetune` flow, as a user runs it: on local storage, on S3, and refusing bad input."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from transformers import AutoModelForSequenceClassification

from conftest import BUCKET, S3_SECRET, write_jsonl
from flows.finetune import finetune
from tasks import storage
from tasks.config import DataConfig, FinetuneParams, ModelConfig, TrainConfig
from tasks.data import DataError
from tasks.predictor import local_model
from tasks.storage import MARKER


def params(tiny_model, data: dict, root: str) -> FinetuneParams:
    return FinetuneParams(
        data=DataConfig(train_uri=str(data["train"]), validation_uri=str(data["validation"]), test_uri=str(data["test"])),
        model=ModelConfig(name_or_path=str(tiny_model), max_length=64),
        train=TrainConfig(epochs=2, batch_size=32, learning_rate=3e-3),
        storage_root=root,
    )


def artifact_keys(flow_run_id) -> set[str]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key for a in found}


def check_run(run_dir: str, summary: dict, data: dict) -> dict:
    """What a user checks after a run: manifest, metrics, a loadable model, one prediction per row."""
    manifest = storage.read_json(storage.join(run_dir, "manifest.json"))
    metrics = storage.read_json(storage.join(run_dir, "metrics.json"))
    assert manifest["metrics"]["test"] == metrics and metrics["accuracy"] == summary["test_accuracy"]
    assert metrics["accuracy"] > 0.6, "the tiny model should learn something from 2048 reviews"
    assert sum(map(sum, metrics["confusion_matrix"])) == metrics["rows"] == 128
    assert set(metrics) >= {"accuracy", "macro_f1", "confusion_matrix"}
    assert manifest["data"]["splits"]["train"]["sha256"] == storage.sha256(str(data["train"]))
    assert manifest["config"]["train"]["seed"] == 42 and "torch" in manifest["versions"]
    assert [row["epoch"] for row in manifest["metrics"]["training"]] == [1, 2]

    model = AutoModelForSequenceClassification.from_pretrained(local_model(storage.join(run_dir, "model")))
    assert model.config.id2label == {0: "negative", 1: "positive"}

    fs, path = storage.filesystem(storage.join(run_dir, "predictions"))
    predictions = pq.read_table(path, filesystem=fs).to_pandas()
    assert set(predictions.columns) == {"id", "text", "label", "score"}
    assert sorted(predictions["id"]) == sorted(f"test.jsonl:{i}" for i in range(128))
    assert set(predictions["label"]) <= {"negative", "positive"} and predictions["score"].between(0.5, 1).all()
    assert storage.read_json(storage.join(run_dir, "predictions", MARKER))["rows"] == 128
    return manifest


def test_finetune_on_local_storage(ray_cluster, tiny_model, small_data, tmp_path):
    state = finetune(params(tiny_model, small_data, str(tmp_path / "store")), return_state=True)
    summary = state.result()
    assert Path(summary["run_dir"]).parent == tmp_path / "store" / "runs"
    check_run(summary["run_dir"], summary, small_data)
    assert {"test-metrics", "confusion-matrix"} <= artifact_keys(state.state_details.flow_run_id)


def test_finetune_on_s3(ray_cluster, tiny_model, small_data):
    data = {}
    for split, path in small_data.items():
        data[split] = f"s3://{BUCKET}/input/{path.name}"
        storage.filesystem(data[split])[0].put_file(str(path), data[split])
    root = f"s3://{BUCKET}/ftflow"
    summary = finetune(params(tiny_model, data, root))
    assert summary["run_dir"].startswith(f"{root}/runs/")
    manifest = check_run(summary["run_dir"], summary, data)
    assert manifest["outputs"]["model"] == f"{summary['run_dir']}/model"

    fs, path = storage.filesystem(root)
    for key in fs.find(path):
        if key.endswith((".json", ".txt", ".parquet")):
            assert S3_SECRET.encode() not in fs.cat_file(key), f"credential written into {key}"


def test_bad_input_stops_the_flow_before_anything_is_written(tiny_model, small_data, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"review": "no text column", "label": 1}])
    bad_params = params(tiny_model, {**small_data, "validation": bad}, str(tmp_path / "store"))
    with pytest.raises(DataError, match=f"{bad}: column 'text' not found"):
        finetune(bad_params)
    assert not (tmp_path / "store").exists()
