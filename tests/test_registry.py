"""The promotion gate and the registry: a first model becomes champion, one that loses leaves the
champion untouched and says so, and batch inference takes `models/<name>@champion`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import BUCKET, free_port, run_batch_infer
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from flows.finetune import finetune
from ftflow.params import BadInput, parameters
from tasks.contracts.metrics import Metrics
from tasks.contracts.promotion import resolve
from tasks.contracts.training import Curve, EpochRecord, Predictions, Result
from tasks.core import layout, storage
from tasks.core.config import DataConfig, FinetuneParams, PromotionConfig
from tasks.core.data import load_splits
from tasks.core.layout import MARKER, RunStore
from tasks.promote.rescore import predicted, score
from tasks.promote.task import Decision, promote
from tasks.report.manifest import Results
from tasks.report.task import summary as report_summary
from tasks.report.tracking import track


def test_a_model_that_loses_leaves_the_champion_untouched(local_run, tmp_path):
    """The second run in a storage root: the first (conftest's local_run) is the champion of `sentiment`."""
    first_params, first_state, _ = local_run
    first, root = first_state.result(), first_params.storage_root
    pointer = layout.StorageRoot(root).champion("sentiment")
    assert first.promoted and storage.read_json(pointer)["model_uri"] == f"{first.run_dir}/model"
    before = storage.filesystem(pointer)[0].cat_file(pointer)

    # One epoch of the same training cannot beat the champion by a margin of 0.5: it must lose. (Any
    # score clears its floor of 0: the decision is the champion's.)
    losing = first_params.model_copy(
        update={
            "promotion": PromotionConfig(margin=0.5, min_score=0.0),
            "train": first_params.train.model_copy(update={"epochs": 1}),
        }
    )
    second = finetune(losing)
    assert not second.promoted
    assert storage.filesystem(pointer)[0].cat_file(pointer) == before, "the champion pointer changed"
    decision = storage.read_json(storage.join(second.run_dir, "manifest.json"))["metrics"]["promotion"]
    assert decision["champion"] == pytest.approx(first.test["accuracy"]), (
        "the champion is scored on the same test split"
    )
    assert "< the champion's" in decision["reason"] and decision["previous_champion_uri"] == f"{first.run_dir}/model"
    report = (Path(root) / "runs" / second.run_id / "report" / "report.md").read_text()
    assert f"Promotion: **not promoted: `sentiment`'s champion is unchanged** ({decision['reason']})" in report

    # Both runs side by side in MLflow (the default store under the storage root), as a person compares them.
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = {
        run.info.run_name: run for run in client.search_runs([client.get_experiment_by_name("sentiment").experiment_id])
    }
    assert set(runs) == {first.run_id, second.run_id}
    for summary, promoted, steps in ((first, "true", 256), (second, "false", 64)):
        run = runs[summary.run_id]
        assert (
            run.data.metrics["test_accuracy"] == summary.test["accuracy"]
            and run.data.tags["ftflow.promoted"] == promoted
        )
        assert run.data.tags["ftflow.model_uri"] == f"{summary.run_dir}/model" and run.data.params[
            "promotion.margin"
        ] in ("0.0", "0.5")
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(10, steps, 10))
        assert {a.path for a in client.list_artifacts(run.info.run_id, "report")} >= {
            "report/report.md",
            "report/training.png",
        }
    assert runs[second.run_id].data.tags["ftflow.promotion"] == decision["reason"]

    out = run_batch_infer(
        "models/sentiment@champion", first_params.data.test_uri, str(tmp_path / "labelled"), storage_root=root
    )
    assert out.rows == 128 and len(pq.read_table(tmp_path / "labelled")) == 128
    assert storage.read_json(str(tmp_path / "labelled" / MARKER))["model"]["uri"] == f"{first.run_dir}/model"


def test_the_champion_is_scored_again_only_on_a_test_split_other_than_its_own(
    ray_cluster, tiny_model, small_data, tmp_path
):
    """Its score recorded at promotion stands for the same rows read the same way; other rows, or the
    same bytes with other label names, score it again."""
    root, cfg = str(tmp_path / "store"), PromotionConfig(model_name="rt", min_score=0)  # made-up scores: no floor
    splits = load_splits(
        DataConfig(
            train_uri=str(small_data["train"]),
            validation_uri=str(small_data["validation"]),
            test_uri=str(small_data["test"]),
        )
    )
    first = RunStore(root, "first")
    shutil.copytree(tiny_model, first.model_dir)  # a model to score again
    promote(first, scored(0.123), splits["test"], cfg)  # a score it never had: recorded
    assert promote(RunStore(root, "same"), scored(0.1), splits["test"], cfg).champion == 0.123
    rescored = promote(RunStore(root, "other"), scored(0.1), splits["validation"], cfg).champion
    assert rescored != 0.123 and 0 <= rescored <= 1
    relabelled = dataclasses.replace(
        splits["test"], schema=dataclasses.replace(splits["test"].schema, label_names=("pos", "neg"))
    )
    assert promote(RunStore(root, "relabelled"), scored(0.1), relabelled, cfg).champion != 0.123


def test_a_model_that_predicts_one_class_is_not_promoted_even_to_an_empty_entry(ray_cluster, tiny_model, tmp_path):
    """What a model that learned nothing scores, always predicting the majority class: under the
    default floor. The decision, the artifact and the report say which floor applied."""
    model = one_class_model(tiny_model, tmp_path / "one-class")
    test = load_splits(DataConfig())["test"]  # the shipped split: 533 of each class
    metrics = score(str(model), test, batch_size=64)
    assert (metrics.accuracy, round(metrics.macro_f1, 4)) == (0.5, 0.3333)
    root = str(tmp_path / "store")

    @flow
    def gate(cfg: PromotionConfig) -> Decision:
        return promote(RunStore(root, "one-class"), metrics, test, cfg)

    state = gate(PromotionConfig(model_name="rt"), return_state=True)
    decision = state.result()
    floor = "accuracy > 0.5000, the score of always predicting the test split's majority class 'negative' (promotion.min_score unset)"
    assert not decision.promoted and not storage.exists(layout.StorageRoot(root).champion("rt"))
    assert decision.reason == f"accuracy 0.5000 is not above the floor: {floor}" and decision.floor == floor
    [artifact] = artifacts_of(state.state_details.flow_run_id, "promotion")
    assert (
        f"not promoted: `rt`'s champion is unchanged ({decision.reason})" in artifact and f"Floor: {floor}." in artifact
    )
    assert f"Promotion floor: {floor}." in report_summary(metrics, decision)
    assert gate(PromotionConfig(model_name="rt", min_score=0.5)).promoted, "an explicit floor is reached, not beaten"


def scored(accuracy: float) -> Metrics:
    """Made-up metrics of a model (a test with no floor reads only the accuracy)."""
    return Metrics(
        accuracy=accuracy, macro_f1=accuracy, confusion_matrix=[[1, 0], [0, 1]], label_names=["a", "b"], rows=2
    )


def one_class_model(model: Path, folder: Path) -> Path:
    """The model, with a classifier that says 'negative' whatever the text."""
    one_class = AutoModelForSequenceClassification.from_pretrained(
        model, id2label=dict(enumerate(DataConfig().targets.names))
    )
    with torch.no_grad():
        one_class.classifier.weight.zero_()
        one_class.classifier.bias.copy_(torch.tensor([1.0, -1.0]))
    one_class.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    return folder


def artifacts_of(flow_run_id, key: str) -> list[str]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        )
    return [artifact.data for artifact in found]


@pytest.mark.parametrize(
    ("given", "line"),
    [
        (["promotion.min_score=1.5"], "promotion.min_score: 1.5 is outside accuracy's range [0, 1]"),
        (
            ["data.task=regression", "promotion.metric=pearson", "promotion.min_score=-2"],
            "promotion.min_score: -2 is outside pearson's range [-1, 1]",
        ),
        (
            ["data.task=regression", "promotion.min_score=-0.1"],
            "promotion.min_score: -0.1 is outside mse's range [0, inf)",
        ),
    ],
)
def test_a_floor_outside_the_metrics_range_is_refused_with_the_parameters(given, line):
    """A floor no score can be on (accuracy 1.5) ran the whole job to "not promoted"; its edges are scores."""
    with pytest.raises(BadInput) as refused:
        parameters(FinetuneParams, None, given)
    assert str(refused.value) == line
    for edge in ("0", "1"):
        assert parameters(FinetuneParams, None, [f"promotion.min_score={edge}"]).promotion.min_score == float(edge)


def test_an_unknown_champion_is_refused_with_where_it_was_looked_for(tmp_path):
    with pytest.raises(
        ValueError,
        match=f"^model_uri models/nobody@champion: the registry entry 'nobody' under {tmp_path} has "
        f"no champion yet \\(no {tmp_path}/models/nobody/champion\\)",
    ):
        resolve("models/nobody@champion", str(tmp_path))
    assert resolve(str(tmp_path / "a-model"), str(tmp_path)) == str(tmp_path / "a-model")


@pytest.mark.parametrize("store", ["local", "s3"])
def test_two_promotions_racing_from_the_same_champion_exactly_one_wins(
    store, ray_cluster, tiny_model, small_data, tmp_path, monkeypatch
):
    root = str(tmp_path / "store") if store == "local" else f"s3://{BUCKET}/race-{uuid.uuid4().hex[:8]}"
    test = load_splits(
        DataConfig(
            train_uri=str(small_data["train"]),
            validation_uri=str(small_data["validation"]),
            test_uri=str(small_data["test"]),
        )
    )["test"]
    cfg = PromotionConfig(model_name="rt", min_score=0)  # made-up scores: no floor
    assert promote(RunStore(root, "first"), scored(0.5), test, cfg).promoted
    # Both challengers read the champion before either goes on: both compare with the same, soon stale,
    # champion, and both would beat it. (The barrier is on the read: scoring takes turns in one process.)
    both_read, reads, read = threading.Barrier(2), itertools.count(), storage.read_versioned_json

    def read_then_wait(uri):
        pointer = read(uri)
        if next(reads) < 2:  # the challengers' reads; the local swap reads again under its lock
            both_read.wait(60)
        return pointer

    monkeypatch.setattr(storage, "read_versioned_json", read_then_wait)
    with ThreadPoolExecutor(2) as pool:
        decisions = dict(
            zip(
                ["a", "b"],
                pool.map(lambda run: promote(RunStore(root, run), scored(1.0), test, cfg), ["a", "b"]),
                strict=True,
            )
        )

    winners = [run for run, decision in decisions.items() if decision.promoted]
    assert len(winners) == 1, decisions
    champion = storage.read_json(layout.StorageRoot(root).champion("rt"))
    assert champion["run_id"] == winners[0] and champion["model_uri"] == f"{root}/runs/{winners[0]}/model"
    loser = decisions[{"a": "b", "b": "a"}[winners[0]]]
    assert loser.previous_champion_uri == RunStore(root, "first").model_dir
    assert loser.champion == decisions[winners[0]].champion
    assert loser.reason.endswith(
        f"but while this run compared, run {winners[0]} made {champion['model_uri']} the "
        f"champion (accuracy 1.0000); the next run compares with it"
    )


def test_an_unreachable_tracking_server_is_a_warning_not_a_failure(tmp_path, monkeypatch, caplog):
    """The tracking task alone, in a flow run, against a port nothing listens on (a finished run's results)."""
    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@127.0.0.1:{port}")
    store = RunStore(str(tmp_path), "r1")
    epoch = EpochRecord(
        epoch=1,
        step=1,
        resumed_from_step=0,
        train_loss=1.0,
        val_loss=1.0,
        val_accuracy=0.5,
        samples_per_s=1.0,
        peak_memory_mb=1.0,
        startup_s=None,
        checkpoint_s=None,
    )
    results = Results(
        test=scored(0.5),
        promotion=Decision(
            promoted=False,
            reason="r",
            floor="f",
            model_name="sentiment",
            metric="accuracy",
            challenger=0.5,
            champion=None,
            previous_champion_uri=None,
            pointer="p",
        ),
        training=Result(history=[epoch], curve=Curve(), validation=Predictions(), nodes=[]),
    )

    @flow
    def tracked_alone() -> str | None:
        return track(FinetuneParams(storage_root=str(tmp_path)), store, results, {"train": 1.0})

    started = time.monotonic()
    state = tracked_alone(return_state=True)
    assert state.is_completed() and state.result() is None and time.monotonic() - started < 60
    [warning] = [record for record in caplog.records if "MLflow" in record.getMessage()]
    assert warning.levelname == "WARNING" and warning.getMessage().startswith(
        f"MLflow tracking at http://127.0.0.1:{port} failed, the run goes on: "
    )
    assert "secret" not in warning.getMessage()


def test_a_pair_models_champion_is_scored_again_on_its_pairs(tiny_model, task_data, tmp_path):
    """The re-score read each row's first text alone, which a model of pairs refuses."""
    model = shutil.copytree(tiny_model, tmp_path / "pairs-model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"text_pair_truncation": "longest_first"}))
    files = {f"{split}_uri": task_data["multi_label"][f"{split}_uri"] for split in ("train", "validation", "test")}
    test = load_splits(DataConfig(**files, text_pair_column="next"))["test"]
    outputs, truth, _ = predicted(str(model), test, batch_size=32, threads=1)
    assert outputs.shape == truth.shape == (128, 2)
