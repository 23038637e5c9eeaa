"""Train: Ray Train workers with DeepSpeed engines; the exported model is the trained one, at every ZeRO stage."""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import torch
from conftest import alongside, fault_injected, faults_injected
from tiny_model import make_tiny_bert
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks.contracts.shards import TokenizedSplits
from tasks.contracts.training import STATE_FILE, Result, TrainingJob
from tasks.core import storage
from tasks.core.config import DataConfig, ModelConfig
from tasks.core.data import load_splits
from tasks.core.layout import RunStore
from tasks.core.targets import Targets
from tasks.core.text import padded
from tasks.core.train_config import TrainConfig
from tasks.tokenize.driver import tokenize_key
from tasks.tokenize.task import tokenize
from tasks.train.plan import planned
from tasks.train.task import train

LABELS = Targets(names=("negative", "positive"))


@pytest.fixture(scope="module")
def tokenized(ray_cluster, tiny_model, small_data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("train-store"))
    splits = load_splits(
        DataConfig(
            train_uri=str(small_data["train"]),
            validation_uri=str(small_data["validation"]),
            test_uri=str(small_data["test"]),
        )
    )
    key = tokenize_key(splits, str(tiny_model), 64, root)
    return root, tokenize.with_options(refresh_cache=not key.shards_exist())(key, splits, str(tiny_model))


def validation_rows(uri: str) -> list[dict]:
    return pq.read_table(uri).sort_by("row").select(["input_ids", "label"]).to_pylist()


def logits_of(model_dir: Path, rows: list[dict]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    return model_logits(model, AutoTokenizer.from_pretrained(model_dir).pad_token_id, rows)


def model_logits(model: torch.nn.Module, pad: int, rows: list[dict]) -> torch.Tensor:
    model.eval()
    logits = []
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            ids = [r["input_ids"] for r in rows[start : start + 32]]
            input_ids, mask = padded(ids, np.array([len(i) for i in ids]), pad)
            logits.append(model(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(mask)).logits)
    return torch.cat(logits)


def assert_model_is_the_trained_engine(
    model_dir: Path, uris: TokenizedSplits, val_accuracy: float, tie: float = 1e-4
) -> None:
    """The exported folder is complete, reloads, and predicts the validation split as the engine did,
    at the validation accuracy the engine had at the step exported."""
    assert {"config.json", "model.safetensors", "tokenizer.json", STATE_FILE} <= {p.name for p in model_dir.iterdir()}
    engine_predictions = json.loads((model_dir / STATE_FILE).read_text())["validation"]["labels"]
    rows = validation_rows(uris.validation)
    logits = logits_of(model_dir, rows)
    reloaded = logits.argmax(-1).tolist()
    margins = (logits[:, 1] - logits[:, 0]).abs().tolist()
    assert len(reloaded) == len(engine_predictions) == 128
    # Only a tie within rounding noise (`tie`) may flip a label between the engine and the reloaded weights.
    assert all(margins[i] < tie for i in range(len(rows)) if reloaded[i] != engine_predictions[i])
    accuracy = sum(p == r["label"] for p, r in zip(reloaded, rows, strict=True)) / len(rows)
    assert accuracy == pytest.approx(val_accuracy, abs=1 / len(rows))


def fit(uris: TokenizedSplits, model: Path, cfg: TrainConfig, run_dir: Path | str) -> Result:
    model_config = ModelConfig(name_or_path=str(model), max_length=64)
    return train(
        TrainingJob(shards=uris, model=model_config, targets=LABELS, train=cfg, store=RunStore.at(str(run_dir)))
    )


STRATEGIES = {
    # ZeRO-0's export is checked on the max_steps test's run (stopped_at_50: ZeRO-0 on 2 workers).
    # ZeRO-1 is DeepSpeed's ZeRO-2 optimizer without gradient partitioning (one class, one export path
    # here): proven by pp2-dp2-zero1 below. ZeRO-2 and ZeRO-3 each run in bf16 (DeepSpeed's bf16 optimizer,
    # fp32 master weights, as a GPU runs them; slowly on this CPU) and ZeRO-3 in fp32 with offload: their
    # fp32 cases alone (dropped, ~100 s) took no path these do not (ZeRO-2's export reads the module as
    # ZeRO-0's does; ZeRO-3's gathers the partitions as the offloaded one does).
    # ZeRO-2's export is fp32 (train.export_precision auto, under 1B parameters); ZeRO-3's is bf16, as a
    # model of 1B parameters or more exports by default.
    "zero2-bf16": {"zero_stage": 2, "precision": "bf16"},
    "zero3-bf16": {"zero_stage": 3, "precision": "bf16", "export_precision": "bf16"},
    # the large-model path, proven small: everything that saves memory at once
    "zero3-offload-ckpt": {
        "zero_stage": 3,
        "offload_params": True,
        "offload_optimizer": True,
        "activation_checkpointing": True,
    },
    # Tensor parallelism exports in test_tensor_parallel_groups_are_placed_within_a_node (2 groups of 2
    # as data-parallel replicas under ZeRO-3, on three nodes). Pipeline parallelism: 2 stages of one
    # encoder layer each, 2 such pipelines as data-parallel replicas under ZeRO-1. Their plain tp2 and
    # pp2 cases (dropped, 42 s) took no export path these do not; llama's TP2 and PP2 train as data
    # parallelism does in test_decoders.
    "pp2-dp2-zero1": {"pipeline_parallel_size": 2, "num_workers": 4, "cpus_per_worker": 0.5, "zero_stage": 1},
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exported_model_predicts_like_the_engine_at_end_of_training(strategy, tokenized, tiny_model):
    root, uris = tokenized
    run_dir = Path(root) / "runs" / strategy
    cfg = export_config(STRATEGIES[strategy])
    check_export(fit(uris, tiny_model, cfg, run_dir), cfg, run_dir, uris, tiny_model)


def export_config(strategy: dict) -> TrainConfig:
    """The strategy's run: 24 steps show what 128 did (the weights moved, asserted in check_export, and
    the engine's last validation is compared with the export's). bf16 trains at 5x the learning rate:
    its rounding flips the labels of a barely trained model's small margins, which its whole epoch at
    2e-3 (18 s more for ZeRO-3 in the suite) widened as well."""
    bf16 = strategy.get("precision") == "bf16"
    run = {"epochs": 1, "max_steps": 24, "batch_size": 16, "learning_rate": 1e-2 if bf16 else 2e-3, "num_workers": 2}
    return TrainConfig(**{**run, **strategy})


def check_export(result: Result, cfg: TrainConfig, run_dir: Path, uris: TokenizedSplits, tiny_model: Path) -> None:
    """The exported model is the trained engine's, in its export precision, labelled; a model-parallel
    worker held its share."""
    model_dir = run_dir / "model"
    assert_model_is_the_trained_engine(
        model_dir, uris, result.kept.validation.accuracy, tie=0.05 if cfg.precision == "bf16" else 1e-4
    )
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model).state_dict()
    exported = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert not torch.equal(
        initial["bert.encoder.layer.0.attention.self.query.weight"],
        exported.state_dict()["bert.encoder.layer.0.attention.self.query.weight"],
    )
    assert exported.config.id2label == dict(enumerate(LABELS.names))
    # fp32 whatever the engine's precision (a bf16 model on a CPU is 2.4x slower), unless asked otherwise
    assert exported.dtype == (torch.bfloat16 if cfg.export_precision == "bf16" else torch.float32)
    if (split := cfg.tensor_parallel_size * cfg.pipeline_parallel_size) > 1:
        # The encoder layers' parameters a worker holds: 1/tp of each (the LayerNorms stay whole: ~1%),
        # or 1/pp of the layers, and ZeRO-3 partitions that again over the data-parallel replicas.
        layers = AutoModelForSequenceClassification.from_pretrained(tiny_model).bert.encoder.layer
        parts = split * (cfg.num_workers // split if cfg.zero_stage == 3 else 1)
        assert result.layer_parameter_mb * 2**20 == pytest.approx(
            sum(p.numel() * 4 for p in layers.parameters()) / parts, rel=0.02
        )


def ray_train_workers() -> list[psutil.Process]:
    """This test session's training workers (its Ray's processes descend from it), not those of any
    other Ray on the machine."""
    workers = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            if "RayTrainWorker" in " ".join(process.cmdline()):
                workers.append(process)
    return workers


def checkpoint_committed(run_dir: Path | str, run: str = ".") -> bool:
    """Ray Train's snapshot (of the run folder `run`, a glob, under run_dir: a folder or an S3 prefix)
    lists a checkpoint: a folder that is still uploading, or not yet registered by the controller, is not
    a checkpoint to resume from. A read that fails (an S3 fault the test injects) says not yet."""
    fs, path = storage.filesystem(str(run_dir))
    fs.invalidate_cache()  # s3fs keeps its listings
    with contextlib.suppress(OSError):
        for snapshot in fs.glob(posixpath.normpath(f"{path}/{run}/train/ray/checkpoint_manager_snapshot.json")):
            return b"checkpoint_dir_name" in fs.cat_file(snapshot)
    return False


def kill_a_worker_once_a_checkpoint_is_committed(
    stop: threading.Event, run_dir: Path | str, killed: list[int], run: str = "."
) -> None:
    """Kill one training worker once a checkpoint of the run folder `run` (a glob) under run_dir is committed."""
    while not stop.is_set():
        if checkpoint_committed(run_dir, run):
            workers = ray_train_workers()
            if workers:
                workers[-1].kill()
                killed.append(workers[-1].pid)
                return
        time.sleep(0.05)


@pytest.fixture
def said():
    """The training task's log records as they come: (Unix time, level, message)."""
    records: list[tuple[float, int, str]] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.created, record.levelno, record.getMessage()))

    handler, logger = Said(), logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_a_killed_and_a_failed_worker_resume_from_the_last_checkpoint(tokenized, tiny_model, said):
    """One run, two failures: a worker killed once a checkpoint is committed, and a worker that raises,
    said at once with its own exception. Each attempt resumes from the last checkpoint; the report's
    curve has every step once across both restarts."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "killed"
    # The fault's step comes ~90 steps (~3 s) after the first checkpoint, at which the worker is killed:
    # the kill lands first, the fault in the attempt after it.
    cfg = TrainConfig(
        epochs=2, batch_size=16, learning_rate=2e-3, num_workers=2, checkpoint_every_steps=10, max_failures=2
    )
    killed = []
    with alongside(kill_a_worker_once_a_checkpoint_is_committed, run_dir, killed), fault_injected(step=105, rank=1):
        trained = fit(uris, tiny_model, cfg, run_dir)

    assert killed, "no training worker was killed"
    [(at, level, line)] = [record for record in said if "failed at step 105" in record[2]]
    raised_at = re.fullmatch(
        r"training worker 1 failed at step 105 \(training\): RuntimeError: injected fault at step 105, at ([\d.]+); "
        r"retrying from step 100, attempt [23] of 3",
        line,
    )
    assert level == logging.WARNING and raised_at, line
    assert at - float(raised_at[1]) < 10, "the failure was said at once"
    assert any(message.startswith("rank 0: resumed from the checkpoint at step 100") for _, _, message in said)
    history, curve, steps_per_epoch = trained.history, trained.curve, 2048 // 16
    assert [row.epoch for row in history] == [1, 2] and history[-1].step == 2 * steps_per_epoch
    assert [row.rows for row in history] == [2048, 2048], "a row trained twice or skipped across the restarts"
    resumed_from = history[-1].resumed_from_step
    assert resumed_from > 0 and resumed_from % 10 == 0, "training restarted from step 0"
    assert_model_is_the_trained_engine(run_dir / "model", uris, trained.kept.validation.accuracy)
    # The report's curve has every step once across the restarts: training every 10 steps
    # (log_every_steps), validation every 100 steps and at each epoch's end.
    assert [point.step for point in curve.train] == list(range(10, 2 * steps_per_epoch + 1, 10))
    assert [point.step for point in curve.validation] == [100, 128, 200, 256]
    assert all(0 <= point.accuracy <= 1 and point.loss > 0 for point in curve.train + curve.validation)
    assert curve.validation[-1].accuracy == history[-1].val_accuracy


def test_a_worker_that_stalls_is_reported_then_its_last_failed_attempt_fails_with_its_own_exception(
    tokenized, tiny_model, said
):
    """A worker that hangs: within stall_warning_s the report is written and one warning names the
    phase and the top stack frame; the run goes on once the worker does. Then a worker that raises with
    no attempt left: the run fails with the worker's own exception, said once."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "stalled"
    cfg = TrainConfig(epochs=1, max_steps=10, batch_size=16, num_workers=2, max_failures=0, stall_warning_s=4)
    hang, fault = {"step": 2, "rank": 0, "hang_s": 15}, {"step": 3, "rank": 0, "hang_s": 0}
    with pytest.raises(RuntimeError) as failed, faults_injected(hang, fault) as hooks:
        with alongside(released_once_warned, said, hooks / "release-0"):
            fit(uris, tiny_model, cfg, run_dir)
    check_stall_report(said, run_dir)
    assert re.fullmatch(r"injected fault at step 3, at [\d.]+", str(failed.value))
    assert [message for _, _, message in said if "failed" in message] == [
        next(
            message
            for _, _, message in said
            if message.startswith(
                "training worker 0 failed at step 3 (training): RuntimeError: injected fault at step 3"
            )
            and message.endswith("; no attempt left of 1: training fails")
        )
    ]


def released_once_warned(stop: threading.Event, said: list[tuple[float, int, str]], release: Path) -> None:
    """The hang ended once the stall it makes is reported (~5 s in, of its 15 s at most)."""
    while not stop.wait(0.2):
        if any(level == logging.WARNING and "'training' at step 2" in message for _, level, message in said):
            release.touch()
            return


def check_stall_report(said: list[tuple[float, int, str]], run_dir: Path) -> None:
    """One warning of the hang at step 2, naming its phase and top frame; the report beside the run,
    with both ranks' stacks, rank 0's in the hang. (Workers slower to start than stall_warning_s, as
    here, have a report of their own.)"""
    [line] = [
        message
        for _, level, message in said
        if level == logging.WARNING and "no progress" in message and "'training'" in message
    ]
    assert re.match(
        r"training has shown no progress for \d+ s: rank [01] is in 'training' at step 2, top frame \S+ ", line
    ), line
    report = Path(re.search(r"stall report: (\S+) ", line)[1])
    assert report.parent == run_dir / "stall"
    stacks = {path.name: path.read_text() for path in report.rglob("*") if path.is_file()}
    assert any("injected" in text for name, text in stacks.items() if "rank 0" in name or "rank-0" in name), sorted(
        stacks
    )
    assert any("rank 1" in name or "rank-1" in name for name in stacks), sorted(stacks)


def test_a_diverged_run_stops_at_once_without_a_retry_or_an_export(tokenized, tiny_model, said):
    """A loss no longer finite is the settings' fault: retried from the last checkpoint, the same rows
    would diverge again (tasks/train/worker.py `Diverged`)."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "diverged"
    cfg = TrainConfig(epochs=1, max_steps=20, batch_size=16, num_workers=1, learning_rate=1e10, log_every_steps=5)
    with pytest.raises(FloatingPointError, match=r"^training diverged: the training loss is nan by step \d+ "):
        fit(uris, tiny_model, cfg, run_dir)
    assert not [message for _, _, message in said if "failed" in message], "no attempt was retried"
    assert not (run_dir / "model").exists()


def test_early_stopping_ends_training_after_evaluations_without_a_higher_accuracy(tokenized, tiny_model, said):
    """A learning rate too small to move the model: no evaluation scores higher than the first, so
    training stops at the second after it, mid-epoch, and says why; a re-run of the run (a flow run
    retried after training) trains no more, and starts no worker to find it has nothing to train."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "early"
    cfg = TrainConfig(
        epochs=2, batch_size=16, num_workers=1, learning_rate=1e-12, eval_every_steps=5, early_stopping_patience=2
    )
    stopped = fit(uris, tiny_model, cfg, run_dir)
    assert [point.step for point in stopped.curve.validation] == [5, 10, 15]
    assert [(row.step, row.val_accuracy) for row in stopped.history] == [(15, stopped.curve.validation[0].accuracy)]
    assert stopped.stopped == (
        "early stopping at step 15: no better val_accuracy in 2 evaluation(s) than step 5's "
        f"{stopped.curve.validation[0].accuracy:.4f}"
    )
    again = fit(uris, tiny_model, cfg, run_dir)
    assert again.history == stopped.history and again.stopped == stopped.stopped, "the re-run trained on"
    assert again.validation == stopped.validation and again.test == stopped.test
    finished = (
        "training: an earlier attempt of this run trained it to its end (step 15) and exported it; no worker started"
    )
    assert [message for _, _, message in said].count(finished) == 1


def test_the_best_validated_step_is_exported_not_the_last(tokenized, tiny_model):
    """keep_best (the default): the step that validated highest is the model exported, loaded back
    from its checkpoint after training went on past it; the Result says which step and why."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "best"
    cfg = TrainConfig(epochs=2, batch_size=16, num_workers=1, learning_rate=2e-3, warmup_ratio=0, eval_every_steps=10)
    trained = fit(uris, tiny_model, cfg, run_dir)
    validation = trained.curve.validation
    best = max(validation, key=lambda point: point.accuracy)
    assert best.accuracy > validation[-1].accuracy, "the case needs a run whose last step is not its best"
    assert trained.kept.validation.accuracy == best.accuracy and trained.kept.step < validation[-1].step == 256
    assert trained.kept.reason == (
        f"the best validated (keep_best): val_accuracy {best.accuracy:.4f}, against {validation[-1].accuracy:.4f} "
        "at the last step, 256"
    )
    assert_model_is_the_trained_engine(run_dir / "model", uris, best.accuracy)


STOPPED_AT_50 = TrainConfig(epochs=2, max_steps=50, batch_size=16, num_workers=2)  # evaluates at step 50 alone


@pytest.fixture(scope="module")
def stopped_at_50(tokenized, tiny_model) -> tuple[Path, Result]:
    """A run of 2 epochs that max_steps stops at step 50; the rerun test continues it in its folder."""
    root, uris = tokenized
    run_dir = Path(root) / "runs" / "rerun"
    return run_dir, fit(uris, tiny_model, STOPPED_AT_50, run_dir)


def test_max_steps_bounds_a_run_and_a_rerun_continues_it(tokenized, tiny_model, stopped_at_50):
    """max_steps stops mid-epoch; a re-run with the same run id (what a Prefect retry of the training
    task or of the flow does) continues from that step, in the middle of the epoch, here on 1 worker
    where 2 began it: the epoch's other rows, each once, and the same global batch."""
    _, uris = tokenized
    run_dir, first = stopped_at_50
    assert [(row.epoch, row.step, row.rows) for row in first.history] == [(round(50 / 128, 4), 50, 50 * 16)]
    check_export(first, STOPPED_AT_50, run_dir, uris, tiny_model)

    longer = fit(uris, tiny_model, TrainConfig(epochs=2, batch_size=16, num_workers=1), run_dir)
    assert longer.history[0] == first.history[0], "the first 50 steps were trained again"
    summary = [(row.epoch, row.step, row.resumed_from_step, row.workers, row.rows) for row in longer.history[1:]]
    assert summary == [(1, 128, 50, 1, 2048), (2, 256, 50, 1, 2048)]
    assert longer.curve.train[: len(first.curve.train)] == first.curve.train
    assert [point.step for point in longer.curve.train] == list(range(10, 257, 10))
    assert_model_is_the_trained_engine(run_dir / "model", uris, longer.kept.validation.accuracy)


def test_evaluating_more_often_trains_the_same_model(tokenized, tiny_model, stopped_at_50, tmp_path):
    """Evaluation cadence is a reporting choice: it must not change the dropout masks of the steps after it."""
    _, uris = tokenized
    _, evaluated_once = stopped_at_50
    often = STOPPED_AT_50.model_copy(update={"eval_every_steps": 10})
    evaluated_often = fit(uris, tiny_model, often, tmp_path / "runs" / "every-10")
    assert [p.step for p in evaluated_once.curve.validation] == [50]
    assert [p.step for p in evaluated_often.curve.validation] == [10, 20, 30, 40, 50]
    assert evaluated_often.curve.train == evaluated_once.curve.train
    assert evaluated_often.curve.validation[-1] == evaluated_once.curve.validation[-1]


# A driver on a cluster of three raylets on this machine: a head of 1 CPU, nodes of 3 and 2 CPUs.
ON_THREE_NODES = """
import json, sys
from pathlib import Path
import ray
from ray.cluster_utils import Cluster
from tasks.contracts.training import TrainingJob
from tasks.train.driver import fit
job = TrainingJob.model_validate_json(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
sizes = {cluster.add_node(num_cpus=cpus).node_id: cpus for cpus in (3, 2)}
ray.init(address=cluster.address)
result = fit(job)
placed = {"node_cpus": [sizes.get(node, 1) for node in result.nodes], "result": result.model_dump(mode="json")}
Path(sys.argv[2]).write_text(json.dumps(placed))  # a file: Ray's workers' log lines reach stdout at any time
ray.shutdown()
cluster.shutdown()
"""


def test_tensor_parallel_groups_are_placed_within_a_node(tokenized, tiny_model, tmp_path):
    """4 workers of 1 CPU as 2 tensor-parallel groups, data-parallel replicas under ZeRO-3: Ray's packing
    alone put 3 on the 3-CPU node and one elsewhere, so one group spanned two nodes; placed, each group
    is on a node of its own. The model they export is the trained engine's, as at every other strategy."""
    _, uris = tokenized
    run_dir = tmp_path / "runs" / "tp2-dp2-zero3"
    cfg = export_config({"tensor_parallel_size": 2, "num_workers": 4, "cpus_per_worker": 1, "zero_stage": 3})
    model = ModelConfig(name_or_path=str(tiny_model), max_length=64)
    job = TrainingJob(shards=uris, model=model, targets=LABELS, train=cfg, store=RunStore.at(str(run_dir)))
    run = subprocess.run(
        [sys.executable, "-c", ON_THREE_NODES, job.model_dump_json(), str(tmp_path / "placed.json")],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    placed = json.loads((tmp_path / "placed.json").read_text())
    assert placed["node_cpus"] in ([3, 3, 2, 2], [2, 2, 3, 3]), placed["node_cpus"]  # the CPUs of each rank's node
    check_export(Result.model_validate(placed["result"]), cfg, run_dir, uris, tiny_model)


def test_strategy_auto_picks_by_the_memory_a_worker_has(tokenized, tiny_model, tmp_path):
    """Plenty of memory: plain data parallelism, the fastest (resolved as `fit` resolves it; ZeRO-0 trains
    in the export test). Less than it needs: the fastest that fits, which trains. Each says what it
    chose and why. Too little for any: refused before any worker. A wider model than the suite's (its
    strategies differ by more than the 1 MB the estimate is rounded to), on the same vocabulary."""
    root, uris = tokenized
    wider = make_tiny_bert(tmp_path / "wider", hidden_size=256, intermediate_size=1024)
    auto = {"strategy": "auto", "num_workers": 2, "batch_size": 16, "max_steps": 3}
    _, ample, _ = planned(
        ModelConfig(name_or_path=str(wider), max_length=64), LABELS, TrainConfig(**auto, memory_per_worker_gb=8.0)
    )
    tight_cfg = TrainConfig(**auto, memory_per_worker_gb=ample.need_gb - 0.001)
    trained = fit(uris, wider, tight_cfg, Path(root) / "runs" / "auto-tight")
    assert trained.history[-1].step == 3
    tight = trained.strategy
    assert ample.settings == {"zero_stage": 0} and ample.reason.endswith("and it is the fastest")
    assert tight.settings != ample.settings and tight.need_gb <= tight.budget_gb < ample.need_gb
    assert "the faster need more (data parallel (ZeRO-0) ~" in tight.reason
    with pytest.raises(
        ValueError, match=r"no strategy fits a worker; the closest, .* needs ~0\.\d+ GiB per worker of the 0.10"
    ):
        fit(
            uris,
            wider,
            TrainConfig(strategy="auto", memory_per_worker_gb=0.1, num_workers=2),
            Path(root) / "runs" / "auto-none",
        )
