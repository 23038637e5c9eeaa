"""Runs compared in MLflow: each finetune run becomes one MLflow run, named by its run id, in the
experiment of the registry entry it competes for (promotion.model_name): its parameters, per-step
curve, final metrics, report and plots, where its model is, and the promotion decision as tags.

Where: MLFLOW_TRACKING_URI (a tracking server, or any store MLflow takes), else a SQLite store under
a local storage root (<root>/mlflow.db, artifacts in <root>/mlflow-artifacts): browse it with
`mlflow ui --backend-store-uri sqlite:///<root>/mlflow.db`. An S3 storage root has no default (a
SQLite file cannot live in a bucket): set MLFLOW_TRACKING_URI. Tracking never fails a run: an
unreachable or refusing server is a warning in the run's log.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import threading
import time
from urllib.parse import urlsplit

from prefect import get_run_logger, task

from tasks.contracts.sweep import SweepResult
from tasks.core import layout, storage
from tasks.core.config import FinetuneParams
from tasks.core.layout import RunStore
from tasks.report.manifest import Results

# MLflow's client retries a failing HTTP request for minutes by default; a run waits for none of it.
HTTP_RETRIES, HTTP_TIMEOUT_S = "0", "10"


def import_beside(storage_root: str) -> None:
    """MLflow's imports in a thread of their own, when this run will be tracked: started before training,
    they are done by its end (1.5 s of the run's end on this CPU, in a process that waits for training)."""
    if tracking_uri(storage_root):
        threading.Thread(target=importlib.import_module, args=("mlflow",), daemon=True).start()


def tracking_uri(storage_root: str) -> str | None:
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    return None if storage.is_remote(storage_root) else f"sqlite:///{layout.StorageRoot(storage_root).mlflow_db}"


def redacted(text: str, uri: str) -> str:
    """text (the URI itself, or an error quoting it) fit for a log line: the URI's user:password@ taken out."""
    parts = urlsplit(uri)
    userinfo, at, _ = parts.netloc.rpartition("@")
    if not at:
        return text
    text = text.replace(userinfo + "@", "")
    return text.replace(parts.password, "***") if parts.password else text


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"epochs": 1}} -> {"train.epochs": "1"}: MLflow's parameters are flat strings."""
    pairs: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            pairs |= flat(value, f"{prefix}{key}.")
        else:
            pairs[f"{prefix}{key}"] = str(value)[:6000]  # MLflow's limit per value
    return pairs


def metric_name(words: str) -> str:
    return words.replace(" ", "_").replace("'", "").replace(",", "")


def metrics_of(results: Results, seconds: dict) -> list[tuple[str, float, int]]:
    """(name, value, step): the curve at its steps, then the final numbers at step 0."""
    curve, last = results.training.curve, results.training.history[-1]
    points = [
        (f"{split}_{measure}", getattr(point, measure), point.step)
        for split, points in (("train", curve.train), ("val", curve.validation))
        for point in points
        for measure in ("loss", "accuracy", "entity_f1")
        if getattr(point, measure) is not None
    ]
    final = {
        **{f"test_{name}": value for name, value in results.test.scores().items()},
        "samples_per_s": last.samples_per_s,
        "peak_memory_mb": last.peak_memory_mb,
        "kept_step": results.training.kept.step if results.training.kept else last.step,
        **{"seconds." + metric_name(stage): value for stage, value in seconds.items() if stage != "phases"},
        **{"seconds.phases." + metric_name(phase): value for phase, value in seconds.get("phases", {}).items()},
    }
    return points + [(name, float(value), 0) for name, value in final.items()]


@task
def track(params: FinetuneParams, store: RunStore, results: Results, seconds: dict) -> str | None:
    """Log the run to MLflow; its MLflow run id, or None when not tracked (a warning says why)."""
    logger, uri = get_run_logger(), tracking_uri(params.storage_root)
    if uri is None:
        logger.info("not tracked in MLflow: an S3 storage root has no default store; set MLFLOW_TRACKING_URI")
        return None
    for name, value in (
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_RETRIES),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S),
    ):
        os.environ.setdefault(name, value)
    try:
        run_id = logged(uri, params, store, results, seconds)
    except Exception as error:  # noqa: BLE001 -- tracking is a record of the run, never a reason to fail it
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        logger.warning(
            "MLflow tracking at %s failed, the run goes on: %s", redacted(uri, uri), redacted(first_line, uri)
        )
        return None
    logger.info(
        "tracked in MLflow at %s: experiment %s, run %s", redacted(uri, uri), params.promotion.model_name, store.run_id
    )
    return run_id


def logged(uri: str, params: FinetuneParams, store: RunStore, results: Results, seconds: dict) -> str:
    from mlflow import MlflowClient  # here: a second of imports the runs that track nothing skip
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(params.promotion.model_name)
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment(
            params.promotion.model_name, artifact_location=default_artifacts(params.storage_root)
        )
    )
    # A flow run retried (same run id) logs into its MLflow run again rather than adding a second one.
    [found] = client.search_runs([experiment_id], f"tags.`ftflow.run_id` = '{store.run_id}'", max_results=1) or [None]
    run = found or client.create_run(experiment_id, run_name=store.run_id, tags={"ftflow.run_id": store.run_id})
    run_id, promotion = run.info.run_id, results.promotion
    stamp = int(time.time() * 1000)
    metrics = [Metric(name, value, stamp, step) for name, value, step in metrics_of(results, seconds)]
    logged_params = [] if found else [Param(key, value) for key, value in flat(params.model_dump(mode="json")).items()]
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics and 100 params a call
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    for start in range(0, len(logged_params), 100):
        client.log_batch(run_id, params=logged_params[start : start + 100])
    client.log_batch(
        run_id,
        tags=[
            RunTag(key, value)
            for key, value in {
                "ftflow.run_dir": store.base,
                "ftflow.model_uri": store.model_dir,
                "ftflow.report": store.report_md,
                "ftflow.promoted": str(promotion.promoted).lower(),
                "ftflow.promotion": promotion.reason,
            }.items()
        ],
    )
    with tempfile.TemporaryDirectory() as folder:
        client.log_artifacts(run_id, str(storage.download_dir(store.report, folder)), "report")
    if results.sweep:
        log_trials(client, experiment_id, run_id, results.sweep)
    client.set_terminated(run_id)
    return run_id


# A trial's MLflow status: one stopped by the scheduler was killed, not failed.
TRIAL_STATUS = {"finished": "FINISHED", "stopped early": "KILLED", "failed": "FAILED"}


def log_trials(client, experiment_id: str, parent_id: str, sweep: SweepResult) -> None:
    """A child run of the sweep's run per trial: its drawn values, its metric, how it ended."""
    from mlflow.entities import Metric, Param, RunTag

    stamp = int(time.time() * 1000)
    for trial in sweep.trials:
        query = f"tags.`ftflow.trial_id` = '{trial.trial_id}' and tags.`mlflow.parentRunId` = '{parent_id}'"
        [found] = client.search_runs([experiment_id], query, max_results=1) or [None]
        child = found or client.create_run(
            experiment_id,
            run_name=trial.trial_id,
            tags={"mlflow.parentRunId": parent_id, "ftflow.trial_id": trial.trial_id},
        )
        values = {
            f"best_{sweep.metric}": trial.best,
            f"last_{sweep.metric}": trial.last,
            "steps": trial.step,
            "seconds": trial.seconds,
        }
        client.log_batch(
            child.info.run_id,
            metrics=[Metric(name, float(value), stamp, 0) for name, value in values.items() if value is not None],
            params=[] if found else [Param(f"train.{name}", str(value)) for name, value in trial.config.items()],
            tags=[RunTag("ftflow.trial_status", trial.status), RunTag("ftflow.trial_ended", trial.how[:5000])],
        )
        client.set_terminated(child.info.run_id, status=TRIAL_STATUS.get(trial.status, "FINISHED"))


def default_artifacts(storage_root: str) -> str | None:
    """Beside the default SQLite store; a server or store the user named keeps its own default."""
    return None if os.environ.get("MLFLOW_TRACKING_URI") else layout.StorageRoot(storage_root).mlflow_artifacts
