"""Token classification end to end, as a user runs it: a tiny token classifier trained, evaluated, promoted
and labelling, under ZeRO-0 from a split in each form (CoNLL, words and tags, a text and its spans), and
under ZeRO-3 from texts with character spans, documents several times the model's length; then batch
inference over rows of words and over raw text."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import read_jsonl, run_batch_infer, write_jsonl

from flows.finetune import finetune
from tasks.core import storage
from tasks.core.config import DataConfig, FinetuneParams, ModelConfig
from tasks.core.train_config import TrainConfig


def entity_run(tiny_model, data: dict, root, **train) -> dict:
    """A finetune run of a tiny token classifier: its manifest, its folder, whether it was promoted."""
    params = FinetuneParams(
        data=DataConfig(**data),
        model=ModelConfig(name_or_path=str(tiny_model), max_length=32),
        # 320 sentences: the tiny model learns which words are which types in ~60 steps at 1e-3
        train=TrainConfig(learning_rate=1e-3, **{"epochs": 4, "batch_size": 16} | train),
        promotion={"model_name": "entities"},
        storage_root=str(root),
    )
    summary = finetune(params)
    manifest = storage.read_json(storage.join(summary.run_dir, "manifest.json"))
    return manifest | {"run_dir": summary.run_dir, "promoted": summary.promoted}


def labels_of(folder: str) -> list[dict]:
    fs, path = storage.filesystem(folder)
    return pq.read_table(path, filesystem=fs).to_pylist()


def check_entities(rows: list[dict]) -> None:
    """What a user checks of batch inference's entities: each is the text at its offsets, of a known type."""
    found = [entity for row in rows for entity in row["entities"]]
    assert found and all(row["text"][e["start"] : e["end"]] == e["text"] for row in rows for e in row["entities"])
    assert {e["label"] for e in found} <= {"person", "location"} and all(0 < e["score"] <= 1 for e in found)


@pytest.fixture(scope="module")
def mixed_run(ray_cluster, tiny_model, entity_data, tmp_path_factory) -> dict:
    """Trained on CoNLL, validated on words and tags, tested on texts with spans."""
    return entity_run(tiny_model, entity_data["mixed"], tmp_path_factory.mktemp("mixed-run"))


def test_a_token_classifier_from_each_form_trains_promotes_and_labels(mixed_run, entity_data):
    metrics = mixed_run["metrics"]["test"]
    assert metrics["task"] == "token_classification" and metrics["rows"] == 48
    assert metrics["entity_f1"] > 0.5 > metrics["floor"]["scores"]["entity_f1"] == 0
    assert {kind["name"] for kind in metrics["types"]} == {"person", "location"}
    assert mixed_run["promoted"]
    validation = mixed_run["metrics"]["training"]["curve"]["validation"]
    assert validation[-1]["entity_f1"] > 0.5, "keep_best and early stopping watch val_entity_f1"
    rows = labels_of(storage.join(mixed_run["run_dir"], "predictions"))
    assert len(rows) == 48 and all(row["tags"] is None for row in rows), "raw text: entities, no tags"
    check_entities(rows)
    report = storage.join(mixed_run["run_dir"], "report")
    assert storage.exists(storage.join(report, "entities.png"))
    assert "## Test sentences" in Path(report, "report.md").read_text()


def test_documents_longer_than_the_model_train_in_windows_under_zero3(ray_cluster, tiny_model, entity_data, tmp_path):
    """Texts of ~100 tokens, model.max_length 32: each is read in windows, and every word gets one prediction."""
    run = entity_run(
        tiny_model, entity_data["documents"] | {"stride": 8}, tmp_path, zero_stage=3, batch_size=8, epochs=6
    )
    metrics, test = run["metrics"]["test"], read_jsonl(Path(entity_data["documents"]["test_uri"]))
    words = sum(len(row["text"].split()) for row in test)
    assert sum(map(sum, metrics["confusion_matrix"])) == words, "a prediction per word, of every window"
    assert metrics["entity_f1"] > 0.5 and run["promoted"]
    assert run["data"]["splits"]["test"]["windows"] > 3 * len(test)
    rows = labels_of(storage.join(run["run_dir"], "predictions"))
    check_entities(rows)


def test_batch_inference_tags_rows_of_words_and_raw_text(mixed_run, entity_data, tmp_path):
    words = read_jsonl(Path(entity_data["words"]["test_uri"]))[:5]
    rows = [{"tokens": row["tokens"]} for row in words] + [{"tokens": "A writer from home, again."}]
    inputs = write_jsonl(tmp_path / "mixed.jsonl", rows)
    run_batch_infer(
        storage.join(mixed_run["run_dir"], "model"), str(inputs), str(tmp_path / "out"), text_column="tokens"
    )
    labelled = labels_of(str(tmp_path / "out"))
    assert [len(row["tags"]) for row in labelled[:5]] == [len(row["tokens"]) for row in words]
    assert labelled[5]["tags"] is None and labelled[5]["text"] == "A writer from home, again."
    check_entities(labelled)
