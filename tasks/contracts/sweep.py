"""What a sweep returns, typed: a record per trial and the best trial's training Result. Imports no
Prefect, Ray or torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from tasks.contracts.training import Result
from tasks.core.sweep_config import Distribution, SweepConfig, shown
from tasks.core.train_config import TrainConfig

Ended = Literal["pending", "running", "finished", "stopped early", "failed"]


def searched(sweep: SweepConfig, train: TrainConfig) -> dict:
    """The search a sweep's id stands for, as its run folder's search.json holds it."""
    return {"sweep": sweep.model_dump(mode="json"), "train": train.model_dump(mode="json")}


class TrialRecord(BaseModel):
    """One trial as the sweep's table shows it."""

    trial_id: str
    config: dict[str, Any]  # the searched train.* fields' values
    status: Ended
    how: str  # how it ended, in words: its epochs, early stopping, the scheduler, or its error's line
    last: float | None = None  # the metric at its last evaluation
    best: float | None = None  # the best over its evaluations
    step: int | None = None  # its last reported optimizer step
    evaluations: int = 0
    seconds: float | None = None
    curve: list[tuple[int, float]] = []  # (evaluation, the metric) at each of its evaluations


class SweepResult(BaseModel):
    metric: str
    direction: str  # max or min
    fields: list[str]  # the searched train.* fields
    space: dict[str, Distribution] = {}  # each field's distribution: how its axis is drawn (a choice's, categories)
    rungs: list[int] = []  # the evaluations at which the scheduler (ASHA) compared the trials
    trials: list[TrialRecord]
    best_trial: str
    training: Result  # the best trial's, as a run's train stage returns it (its model copied to the run's)

    def best(self) -> TrialRecord:
        return next(trial for trial in self.trials if trial.trial_id == self.best_trial)

    def shown(self, name: str, value: Any) -> str:
        """A field's value in its column's notation (a result recorded before `space` was, as it comes)."""
        return self.space[name].shown(value) if name in self.space else shown(value)
