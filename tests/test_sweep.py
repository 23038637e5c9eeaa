"""The `sweep` flow on the tiny model: trials under ASHA, the best carried on, shown as it runs, in
MLflow as a parent and its children; killed, then continued under the same id, its unfinished trial
from its checkpoint, a worker failure in a trial survived; its finished trials not run again."""

from __future__ import annotations

import re
from itertools import combinations
from pathlib import Path

import pytest
import yaml
from conftest import fault_injected, session_prefect
from matplotlib.backends.backend_agg import FigureCanvasAgg
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from ray.util.placement_group import placement_group_table
from test_cli import killed_once_resumable
from test_flow import params, run_artifacts
from test_train import checkpoint_committed

from flows.sweep import sweep
from tasks.contracts.sweep import SweepResult, TrialRecord
from tasks.contracts.training import STATE_FILE, Curve, Predictions, Result
from tasks.core import storage
from tasks.core.sweep_config import Distribution, SweepConfig, SweepParams, shown
from tasks.core.train_config import TrainConfig
from tasks.report.plots import sweep_curves_figure, sweep_figure
from tasks.report.tracking import tracking_uri

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
                trials=3,
                metric="val_loss",
                grace_period=1,
                seed=3,
            ).model_dump(),
        }
    )


def trial_state_times(run_dir: str) -> dict[str, float]:
    """When each finished trial wrote its Result: a trial trained again writes it again."""
    return {path.parts[-3]: path.stat().st_mtime for path in Path(run_dir, "trials").glob(f"*/model/{STATE_FILE}")}


def killed_in_its_first_trial(searched: SweepParams, tmp_path: Path) -> None:
    """`ftflow sweep` killed in its first trial, hung at step 6 after the checkpoint of its first
    evaluation (step 4, a new best) and once Ray Tune has saved its experiment: none of its processes left."""
    run_dir = Path(searched.storage_root, "runs", searched.run_id)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(searched.model_dump(mode="json")))
    killed_once_resumable(
        ["sweep", "--params", str(tmp_path / "sweep.yaml")],
        lambda: checkpoint_committed(run_dir, "trials/*") and any(run_dir.glob("tune/experiment_state-*.json")),
        step=6,
        **session_prefect(),  # the temporary server's start (~13 s) is test_cli's to check
    )


def test_a_sweep_stops_the_trailing_trials_carries_the_best_on_and_continues_by_id(tiny_model, small_data, tmp_path):
    root = str(tmp_path / "store")
    searched = sweep_params(tiny_model, small_data, root, "sweep-1")
    killed_in_its_first_trial(searched, tmp_path)
    # The same id again, rank 0 failing at step 5 of each trial (once): the killed trial resumes and
    # survives it; a trial ASHA stops at step 4 fails too as it is stopped, and its controller's new
    # workers' CPUs are given back all the same.
    with fault_injected(step=5, rank=0):
        state = sweep(searched, return_state=True)
    summary = state.result()
    assert not [group for group in placement_group_table().values() if group["state"] != "REMOVED"]
    manifest = storage.read_json(storage.join(summary.run_dir, "manifest.json"))
    swept = manifest["metrics"]["sweep"]
    trials = {trial["trial_id"]: trial for trial in swept["trials"]}
    assert len(trials) == 3 and {trial["config"]["learning_rate"] for trial in trials.values()} == set(LEARNING_RATES)
    assert swept["space"]["learning_rate"]["choice"] == LEARNING_RATES and swept["rungs"][0] == 1, (
        "the search, as drawn"
    )
    assert any(trial["status"] == "stopped early" for trial in trials.values()), trials
    best = trials[swept["best_trial"]]
    finished = [trial for trial in trials.values() if trial["status"] == "finished"]
    assert best["status"] == "finished" and best["best"] == min(trial["best"] for trial in finished)
    assert best["config"]["learning_rate"] == 1e-12
    # Every trial read the one set of tokenized shards; the best trial's model is the sweep's.
    assert len(list(Path(root, "tokenized").iterdir())) == 1
    best_model = Path(summary.run_dir, "trials", best["trial_id"], "model")
    assert (best_model / "model.safetensors").read_bytes() == Path(
        summary.run_dir, "model", "model.safetensors"
    ).read_bytes()
    training = manifest["metrics"]["training"]
    assert training["history"][-1]["step"] == 12 and summary.test["accuracy"] > 0
    # The killed trial (the first drawn, the best) went on from its checkpoint; keep_best by the sweep's metric.
    assert training["history"][-1]["resumed_from_step"] == 4
    assert training["kept"]["validation"]["loss"] == best["best"]

    report = Path(summary.run_dir, "report", "report.md").read_text()
    assert "## Sweep" in report and f"**{best['trial_id']}**" in report and "(sweep.png)" in report
    assert "(sweep-curves.png)" in report and Path(summary.run_dir, "report", "sweep-curves.png").exists()
    # What the curves picture draws: each trial's metric at each of its evaluations, the killed one's too.
    for trial in trials.values():
        assert [evaluation for evaluation, _ in trial["curve"]] == list(range(1, trial["evaluations"] + 1)), trial
    assert all(f"| {trial_id} |" in report for trial_id in trials if trial_id != best["trial_id"])
    # As it ran: a line per trial's progress and the sweep's, and the sweep's progress artifact, done.
    with get_client(sync_client=True) as client:
        logs = [
            log.message
            for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            )
        ]
    assert any(line.startswith("sweep: 3 / 3 trials") for line in logs), logs
    assert all(any(line.startswith(f"trial {trial_id}: ") for line in logs) for trial_id in trials)
    finished_line = f"trial {best['trial_id']}: 3 evaluations, finished, learning_rate 1e-12, val_loss "
    assert any(line.startswith(finished_line) for line in logs), logs
    failed_line = f"trial {best['trial_id']}: training worker 0 failed at step 5 (training): RuntimeError: injected"
    assert any(line.startswith(failed_line) for line in logs), logs
    assert run_artifacts(state.state_details.flow_run_id)["sweep-progress"] == 100.0
    # MLflow: the sweep's run, with a child run per trial.
    client = MlflowClient(tracking_uri(root))
    [parent] = client.search_runs(
        client.get_experiment_by_name("sentiment").experiment_id, "tags.`ftflow.run_id` = 'sweep-1'"
    )
    children = client.search_runs(parent.info.experiment_id, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(child.data.tags["ftflow.trial_id"] for child in children) == sorted(trials)
    pictures = {artifact.path for artifact in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/sweep.png", "report/sweep-curves.png"} <= pictures, pictures

    # The same id again: nothing trains again, and the same trials come back.
    written = trial_state_times(summary.run_dir)
    again = sweep(searched)
    assert trial_state_times(again.run_dir) == written and len(written) == len(finished)
    assert storage.read_json(storage.join(again.run_dir, "manifest.json"))["metrics"]["sweep"] == swept
    # Another search under the same id: refused, before anything runs.
    other = searched.model_copy(update={"sweep": searched.sweep.model_copy(update={"trials": 4})})
    with pytest.raises(ValueError, match=r"^sweep\.trials: 4, but sweep sweep-1 started with 3: "):
        sweep(other)


def test_a_searched_value_is_shown_as_a_person_writes_it():
    """Issue 59: a log-uniform learning rate's trials read alike, whatever their decade."""
    values = [2.42e-4, 2e-4, 2.35e-05, 1e-12, 0.05, 0.001, 3.0, 0.0, 12345.0, -4.5e-6, 2, "linear"]
    assert [shown(value) for value in values] == [
        "2.42e-4",
        "2e-4",
        "2.35e-5",
        "1e-12",
        "0.05",
        "0.001",
        "3",
        "0",
        "1.23e4",
        "-4.5e-6",
        "2",
        "linear",
    ]
    # A field's values in one notation: a learning rate's from 1e-4 to 3e-3 all in powers of ten, as the
    # table, the progress lines and the picture's axis show them (a sweep showed 0.00252 beside 5.7e-4).
    rates, dropouts = Distribution(loguniform=(1e-4, 3e-3)), Distribution(uniform=(0.0, 0.5))
    assert [rates.shown(value) for value in (0.00252, 5.7e-4, 1e-3)] == ["2.52e-3", "5.7e-4", "1e-3"]
    assert [dropouts.shown(value) for value in (0.25, 0.0)] == ["0.25", "0"]
    assert Distribution(choice=[16, 32]).shown(16) == "16"


def test_the_sweeps_pictures_read_and_show_the_curves_asha_judged():
    """Issue 59: a log-uniform learning rate within one decade and a choice of epochs, as an AG News
    sweep drew them: the log axis labelled without its labels running together, the choice as columns;
    and each trial's metric per evaluation, the best marked, where the stopped ones stopped, the rungs."""
    rates, epochs = (2.3e-5, 4.1e-5, 9.7e-5, 1.8e-4), (1, 2, 2, 1)
    trials = [
        TrialRecord(
            trial_id=f"t{i}",
            config={"learning_rate": rate, "epochs": epoch},
            status="finished" if i == 2 else "stopped early",
            how="",
            best=0.5 + i / 10,
            curve=[(1, 0.5), (2, 0.5 + i / 10)][: 2 if i == 2 else 1 + i % 2],
        )
        for i, (rate, epoch) in enumerate(zip(rates, epochs, strict=True))
    ]
    space = {"learning_rate": {"loguniform": [2e-5, 1e-3]}, "epochs": {"choice": [1, 2]}}
    sweep = SweepResult(
        metric="val_accuracy",
        direction="max",
        fields=list(space),
        space=space,
        trials=trials,
        best_trial="t2",
        rungs=[1, 2],
        training=Result(history=[], curve=Curve(), validation=Predictions(), nodes=[]),
    )
    curves = sweep_curves_figure(sweep).axes[0]
    assert [line.get_label() for line in curves.get_lines() if not line.get_label().startswith("_")] == [
        "t0",
        "t1",
        "t2 (best)",
        "t3",
    ]
    stopped = [line for line in curves.get_lines() if line.get_marker() == "x"]
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in stopped] == [(1, 0.5), (2, 0.6), (2, 0.8)]
    assert len(curves.get_lines()) == 2 + 4 + 3, "the rungs, a line per trial, a cross per stopped trial"
    figure = sweep_figure(sweep)
    rate_axes, epoch_axes = figure.axes
    assert rate_axes.get_xscale() == "log" and epoch_axes.get_xscale() == "linear"
    assert [label.get_text() for label in epoch_axes.get_xticklabels()] == ["1", "2"]
    rate_labels = [label.get_text() for label in rate_axes.get_xticklabels() if label.get_text()]
    assert rate_labels and all(re.fullmatch(r"\d(\.\d+)?e-\d+", text) for text in rate_labels), rate_labels
    for picture in (figure, curves.figure):
        assert_labels_read(picture)
    assert [text.get_text() for text in rate_axes.get_legend().get_texts()] == ["finished", "stopped early", "best: t2"]
    # a sweep no scheduler cut short says nothing of stopping
    finished = sweep.model_copy(
        update={"trials": [trial.model_copy(update={"status": "finished"}) for trial in trials]}
    )
    assert [text.get_text() for text in sweep_figure(finished).axes[0].get_legend().get_texts()] == [
        "finished",
        "best: t2",
    ]
    assert sweep_curves_figure(finished).axes[0].get_title() == "each trial's evaluations"


def assert_labels_read(figure) -> None:
    """Every axis of every plot shows at least two tick labels within its limits, none over another."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    for axes in figure.axes:
        for labels, ticks, limits, name in (
            (axes.get_xticklabels(), axes.get_xticks(), axes.get_xlim(), axes.get_xlabel()),
            (axes.get_yticklabels(), axes.get_yticks(), axes.get_ylim(), axes.get_ylabel()),
        ):
            shown = [
                label.get_window_extent(renderer)
                for label, at in zip(labels, ticks, strict=True)
                if label.get_text() and min(limits) <= at <= max(limits)
            ]
            assert len(shown) >= 2, name
            assert not any(a.overlaps(b) for a, b in combinations(shown, 2)), name
