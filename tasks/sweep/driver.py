"""The sweep's driver side (a Ray job on the cluster, no Prefect): Ray Tune draws the trials from the
space and runs each (tasks/sweep/trial.py) under its scheduler, ASHA by default; its experiment state
in the sweep's run folder (tune/) is what a re-run with the same id restores: finished and stopped
trials are not run again, unfinished ones resume from their checkpoints. Then the best finished
trial's model is copied to the sweep's model folder, for the run's next stages."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from itertools import count, takewhile

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from tasks.contracts.sweep import Ended, SweepResult, TrialRecord, searched
from tasks.contracts.training import STATE_FILE, Result, TrainingJob
from tasks.core import jobs, storage
from tasks.core.layout import RunStore
from tasks.core.progress import Tick, log_tick, relayed
from tasks.core.strict import first_line
from tasks.core.sweep_config import SweepConfig
from tasks.core.train_config import TrainConfig
from tasks.sweep.trial import run_trial
from tasks.train import release_placement_groups

TRIAL_DRIVER_MEMORY = 256 * 2**20
RELEASE_POLL_S = 0.2


def search(job: TrainingJob, sweep: SweepConfig) -> SweepResult:
    """The stage's Ray work (tasks/core/jobs.py runs it where the cluster is): the trials, each the job
    with its drawn train.* fields, then the best."""
    logger, store = jobs.log, job.store
    with relayed(logger) as channel:
        trainable = tune.with_parameters(run_trial, job=job, channel=channel)
        # The trial's own process only drives Ray Train, whose workers take the CPUs and GPUs: Tune's
        # default CPU per trial would be one fewer for them (on 2 cores, no room for the workers), and
        # even a hundredth of one left Ray Data's read tasks without the CPU they wait for (the first
        # batch never came). Tune refuses an empty request: the memory its process takes, and no CPU.
        trainable = tune.with_resources(trainable, {"CPU": 0, "memory": TRIAL_DRIVER_MEMORY})
        grid = tuner(trainable, sweep, job.train, store, logger).fit()
    trials = sorted((record(result, sweep, store) for result in grid), key=lambda trial: trial.trial_id)
    return best_of(trials, sweep, store)


def tuner(trainable, sweep: SweepConfig, train: TrainConfig, store: RunStore, logger: logging.Logger) -> tune.Tuner:
    """The sweep's Tuner: restored from its experiment state where an earlier attempt left one."""
    experiment, filesystem = storage.pyarrow_filesystem(store.tune)
    parent, name = experiment.rsplit("/", 1)
    if tune.Tuner.can_restore(experiment, storage_filesystem=filesystem):
        logger.info("sweep %s: continuing its trials from %s", store.run_id, store.tune)
        return tune.Tuner.restore(
            experiment, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=filesystem
        )
    storage.write_json(store.search, searched(sweep, train))  # what a re-run with this id must give (task.py)
    return tune.Tuner(
        trainable,
        param_space={name: distribution.tune() for name, distribution in sweep.fields().items()},
        tune_config=tune.TuneConfig(
            num_samples=sweep.trials,
            # Tune's max_concurrent_trials let 4 trials start at once here: the generator's own limit holds
            search_alg=BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.concurrent),
            scheduler=scheduler(sweep),
            trial_dirname_creator=lambda trial: trial.trial_id,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=parent,
            storage_filesystem=filesystem,
            callbacks=[TrialTable(sweep, store)],
            failure_config=tune.FailureConfig(max_failures=0),  # worker failures: train.max_failures, in the trial
            verbose=0,  # the trial table is ftflow's (TrialTable)
        ),
    )


def rungs(sweep: SweepConfig, most: int) -> list[int]:
    """The evaluations at which ASHA compares the trials, up to the most any trial made."""
    if sweep.scheduler == "none":
        return []
    return list(takewhile(lambda rung: rung <= most, (sweep.grace_period * sweep.reduction_factor**k for k in count())))


def scheduler(sweep: SweepConfig):
    """ASHA counts time in evaluations (each trial's reports carry how many it has made), so its grace
    period is a number of evaluations; max_t is only a ceiling no trial reaches."""
    if sweep.scheduler == "none":
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr="evaluations",
        metric=sweep.metric,
        mode=sweep.direction,
        grace_period=sweep.grace_period,
        reduction_factor=sweep.reduction_factor,
        max_t=10**6,
    )


def finished(store: RunStore, trial_id: str) -> Result | None:
    """The trial's Result, if it trained to its end and exported its model."""
    state = storage.join(store.trial(trial_id).model_dir, STATE_FILE)
    return Result.model_validate(storage.read_json(state)) if storage.exists(state) else None


def how_it_ended(error: BaseException | None, result: Result | None, evaluations: int) -> tuple[Ended, str]:
    if error is not None:
        return "failed", first_line(error)
    if result is not None:
        return "finished", result.stopped
    return "stopped early", f"stopped by the scheduler after {evaluations} evaluation(s)"


def evaluated(result: tune.Result, trained: Result | None, metric: str) -> list[tuple[int, float]]:
    """The trial's metric at each of its evaluations. A finished trial's from its own curve, which keeps
    every point once across restarts: Tune's history of a trial starts again where it was restored (a
    trial killed, then resumed by the same sweep id, lacked its evaluations before the kill)."""
    if trained is not None:
        return [(n, point.value(metric)) for n, point in enumerate(trained.curve.validation, 1)]
    history = result.metrics_dataframe
    if history is None or not {"evaluations", metric} <= set(history):
        return []
    rows = history[["evaluations", metric]].dropna()
    return [(int(n), float(value)) for n, value in zip(rows["evaluations"], rows[metric], strict=True)]


def record(result: tune.Result, sweep: SweepConfig, store: RunStore) -> TrialRecord:
    """A trial's row, from what Tune recorded of it and what it left in its folder."""
    trial_id = storage.normalize(result.path).rstrip("/").rsplit("/", 1)[-1]
    trained = finished(store, trial_id)
    curve = evaluated(result, trained, sweep.metric)
    values = [value for _, value in curve]
    evaluations = int(result.metrics.get("evaluations", 0))
    status, how = how_it_ended(result.error, trained, evaluations)
    return TrialRecord(
        trial_id=trial_id,
        config={name: result.config[name] for name in sweep.fields()},
        status=status,
        how=how,
        last=values[-1] if values else None,
        best=(max if sweep.direction == "max" else min)(values) if values else None,
        step=result.metrics.get("step"),
        evaluations=evaluations,
        seconds=result.metrics.get("time_total_s"),
        curve=curve,
    )


def best_of(trials: list[TrialRecord], sweep: SweepConfig, store: RunStore) -> SweepResult:
    """The finished trial with the best metric; its model copied to the sweep's model folder."""
    done = [trial for trial in trials if trial.status == "finished" and trial.best is not None]
    if not done:
        failed = next((trial for trial in trials if trial.status == "failed"), None)
        raise RuntimeError(
            f"no trial of sweep {store.run_id} finished"
            + (f"; trial {failed.trial_id}: {failed.how}" if failed else "")
        )
    sign = 1 if sweep.direction == "max" else -1
    best = max(done, key=lambda trial: sign * trial.best)
    storage.copy_dir(store.trial(best.trial_id).model_dir, store.model_dir)
    if storage.exists(adapter := store.trial(best.trial_id).adapter_dir):  # a LoRA trial's adapter alone
        storage.copy_dir(adapter, store.adapter_dir)
    return SweepResult(
        metric=sweep.metric,
        direction=sweep.direction,
        fields=list(sweep.fields()),
        space=sweep.space["train"],
        rungs=rungs(sweep, max(trial.evaluations for trial in trials)),
        trials=trials,
        best_trial=best.trial_id,
        training=finished(store, best.trial_id),
    )


def release_when_gone(actor, train_dir: str) -> None:
    """Once the trial's process has ended, release its workers' placement group. Tune says a trial
    ended before it stops its process: released then, the workers' loss made Ray Train start new ones
    in a new group, which outlived the trial and left the next one waiting for CPUs."""
    with contextlib.suppress(ray.exceptions.RayActorError):
        while True:
            ray.get(actor.__ray_ready__.remote())
            time.sleep(RELEASE_POLL_S)
    release_placement_groups(train_dir)


class TrialTable(tune.Callback):
    """The sweep as it runs: a tick per trial (the console's row for it: its values, its status, its
    metric) and one for the sweep (trials ended of all, the best so far: the Prefect UI's progress)."""

    def __init__(self, sweep: SweepConfig, store: RunStore):
        self.sweep, self.store = sweep, store
        self.seen: dict[str, list[float]] = {}  # each trial's metric values so far
        self.evaluations: dict[str, int] = {}
        self.ended: dict[str, str] = {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.show(trial, "running", trials)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.sweep.metric in result:
            self.seen.setdefault(trial.trial_id, []).append(result[self.sweep.metric])
        self.evaluations[trial.trial_id] = result.get("evaluations", 0)  # trial.last_result is the one before
        self.show(trial, "running", trials)

    def on_trial_complete(self, iteration, trials, trial, **info):
        status = "finished" if finished(self.store, trial.trial_id) else "stopped early"
        self.ended_as(trial, status, trials)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.ended_as(trial, "failed", trials)

    def ended_as(self, trial, status: str, trials) -> None:
        """A trial stopped or failed gives its workers' CPUs and GPUs back, for the next."""
        if status != "finished" and (actor := trial.temporary_state.ray_actor) is not None:
            train_dir = self.store.trial(trial.trial_id).train_dir
            threading.Thread(target=release_when_gone, args=(actor, train_dir), daemon=True).start()
        self.ended[trial.trial_id] = status
        self.show(trial, status, trials)

    def best(self, values: list[float]) -> float:
        return (max if self.sweep.direction == "max" else min)(values)

    def show(self, trial, status: str, trials) -> None:
        values = self.seen.get(trial.trial_id, [])
        drawn = ", ".join(f"{name} {space.shown(trial.config[name])}" for name, space in self.sweep.fields().items())
        metric = f", {self.sweep.metric} {values[-1]:.4f} (best {self.best(values):.4f})" if values else ""
        log_tick(
            jobs.log,
            Tick(
                stage=f"trial {trial.trial_id}",
                done=self.evaluations.get(trial.trial_id, 0),
                total=None,
                unit="evaluations",
                text=f"{status}, {drawn}{metric}",
            ),
        )
        self.show_sweep()

    def show_sweep(self) -> None:
        leader = max(
            (trial for trial in self.seen if self.seen[trial]),
            key=lambda trial: self.best(self.seen[trial]) * (1 if self.sweep.direction == "max" else -1),
            default=None,
        )
        best = f"best so far: trial {leader}, {self.sweep.metric} {self.best(self.seen[leader]):.4f}" if leader else ""
        counts = {status: list(self.ended.values()).count(status) for status in ("finished", "stopped early", "failed")}
        log_tick(
            jobs.log,
            Tick(
                stage="sweep",
                done=len(self.ended),
                total=self.sweep.trials,
                unit="trials",
                text=", ".join([f"{n} {status}" for status, n in counts.items() if n] + ([best] if best else [])),
            ),
        )
