"""The `sweep` flow on the tiny model: trials under ASHA, the best carried on, shown as it runs, in
MLflow as a parent and its children, and continued, not run again, under the same id."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from test_flow import params, run_artifacts

from flows.sweep import sweep
from tasks.core import storage
from tasks.core.sweep_config import SweepConfig, SweepParams
from tasks.core.train_config import TrainConfig
from tasks.report.tracking import tracking_uri
from tasks.train.contract import STATE_FILE

# One that throws the model's validation loss far up in a few steps, one that leaves it where it is:
# drawn with seed 3, the second comes first, so ASHA has a better trial to stop the others against.
LEARNING_RATES = [0.05, 1e-12]


def sweep_params(tiny_model, data: dict, root: str, run_id: str) -> SweepParams:
    run = params(tiny_model, data, root).model_dump()
    return SweepParams.model_validate(
        {
            **run,
            "run_id": run_id,
            # 3 evaluations per trial, the first after 4 steps: where ASHA compares the trials
            "train": TrainConfig(
                max_steps=12, batch_size=32, num_workers=1, eval_every_steps=4, warmup_ratio=0
            ).model_dump(),
            "sweep": SweepConfig(
                space={"train.learning_rate": {"choice": LEARNING_RATES}},
                trials=4,
                metric="val_loss",
                grace_period=1,
                seed=3,
            ).model_dump(),
        }
    )


def trial_state_times(run_dir: str) -> dict[str, float]:
    """When each finished trial wrote its Result: a trial trained again writes it again."""
    return {path.parts[-3]: path.stat().st_mtime for path in Path(run_dir, "trials").glob(f"*/model/{STATE_FILE}")}


def test_a_sweep_stops_the_trailing_trials_carries_the_best_on_and_continues_by_id(tiny_model, small_data, tmp_path):
    root = str(tmp_path / "store")
    state = sweep(sweep_params(tiny_model, small_data, root, "sweep-1"), return_state=True)
    summary = state.result()
    manifest = storage.read_json(storage.join(summary.run_dir, "manifest.json"))
    searched = manifest["metrics"]["sweep"]
    trials = {trial["trial_id"]: trial for trial in searched["trials"]}
    assert len(trials) == 4 and {trial["config"]["learning_rate"] for trial in trials.values()} == set(LEARNING_RATES)
    assert any(trial["status"] == "stopped early" for trial in trials.values()), trials
    best = trials[searched["best_trial"]]
    finished = [trial for trial in trials.values() if trial["status"] == "finished"]
    assert best["status"] == "finished" and best["best"] == min(trial["best"] for trial in finished)
    assert best["config"]["learning_rate"] == 1e-12
    # Every trial read the one set of tokenized shards; the best trial's model is the sweep's.
    assert len(list(Path(root, "tokenized").iterdir())) == 1
    best_model = Path(summary.run_dir, "trials", best["trial_id"], "model")
    assert (best_model / "model.safetensors").read_bytes() == Path(
        summary.run_dir, "model", "model.safetensors"
    ).read_bytes()
    assert manifest["metrics"]["training"]["history"][-1]["step"] == 12 and summary.test_accuracy > 0

    report = Path(summary.run_dir, "report", "report.md").read_text()
    assert "## Sweep" in report and f"**{best['trial_id']}**" in report and "(sweep.png)" in report
    assert all(f"| {trial_id} |" in report for trial_id in trials if trial_id != best["trial_id"])
    # As it ran: a line per trial's progress and the sweep's, and the sweep's progress artifact, done.
    with get_client(sync_client=True) as client:
        logs = [
            log.message
            for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            )
        ]
    assert any(line.startswith("sweep: 4 / 4 trials") for line in logs), logs
    assert all(any(line.startswith(f"trial {trial_id}: ") for line in logs) for trial_id in trials)
    finished_line = f"trial {best['trial_id']}: 3 evaluations, finished, learning_rate 1e-12, val_loss "
    assert any(line.startswith(finished_line) for line in logs), logs
    assert run_artifacts(state.state_details.flow_run_id)["sweep-progress"] == 100.0
    # MLflow: the sweep's run, with a child run per trial.
    client = MlflowClient(tracking_uri(root))
    [parent] = client.search_runs(
        client.get_experiment_by_name("sentiment").experiment_id, "tags.`ftflow.run_id` = 'sweep-1'"
    )
    children = client.search_runs(parent.info.experiment_id, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(child.data.tags["ftflow.trial_id"] for child in children) == sorted(trials)

    # The same id again: nothing trains again, and the same trials come back.
    written = trial_state_times(summary.run_dir)
    again = sweep(sweep_params(tiny_model, small_data, root, "sweep-1"))
    assert trial_state_times(again.run_dir) == written and len(written) == len(finished)
    assert storage.read_json(storage.join(again.run_dir, "manifest.json"))["metrics"]["sweep"] == searched
