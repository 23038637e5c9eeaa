"""A sweep's parameters, SweepParams: a run's (FinetuneParams) plus the search, SweepConfig, whose space
is a distribution per `train.*` field. Every point of the space is checked against TrainConfig before
anything starts, so a trial never fails on a value the search could have refused."""

from __future__ import annotations

from functools import reduce
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from tasks.core.config import FinetuneParams
from tasks.core.strict import Strict, one_line
from tasks.core.train_config import BETTER, Lora, Monitor, TrainConfig, task_monitor


def shown(value: Any, powers: bool = False) -> str:
    """A searched value as a person writes it: 3 significant digits, in powers of ten (2.42e-4, 2e-4
    beside 2.35e-5) where `powers` says so or the value is below 0.001 or from 10,000 (Python's `.3g`
    gave 0.000242 beside 2.35e-05)."""
    if not isinstance(value, float):
        return str(value)
    if value == 0 or not powers and 1e-3 <= abs(value) < 1e4:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


class Distribution(Strict):
    """Where one field's values are drawn from: exactly one of these."""

    loguniform: tuple[float, float] | None = Field(None, description="[low, high], low > 0: for learning rates.")
    uniform: tuple[float, float] | None = Field(None, description="[low, high].")
    choice: list[Any] | None = Field(None, description="The values, drawn with equal chances.")

    @model_validator(mode="after")
    def _one_kind(self) -> Distribution:
        given = [kind for kind in ("loguniform", "uniform", "choice") if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of loguniform, uniform or choice, not {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("choice is empty: give at least one value")
        if bounds := self.loguniform or self.uniform:
            low, high = bounds
            if not low < high:
                raise ValueError(f"[{low:g}, {high:g}] is an empty range: low must be below high")
            if self.loguniform and low <= 0:
                raise ValueError(f"loguniform [{low:g}, {high:g}]: low must be above 0")
        return self

    def points(self) -> list[Any]:
        """Values the check tries against the field: the choices, or both bounds and a fractional point
        between them (which an integer field refuses: draw its values with choice)."""
        if self.choice is not None:
            return self.choice
        low, high = self.loguniform or self.uniform
        return [low, low**0.63 * high**0.37 if self.loguniform else low + (high - low) * 0.37, high]

    def shown(self, value: Any) -> str:
        """One of this field's values, in the notation of all of them (the trial table's column, the
        progress lines, the picture's axis): powers of ten for each where the field reaches below 0.001
        or from 10,000, so 2.52e-3 beside 5.7e-4, not 0.00252."""
        magnitudes = [abs(point) for point in self.points() if isinstance(point, float) and point]
        return shown(value, powers=bool(magnitudes) and (min(magnitudes) < 1e-3 or max(magnitudes) >= 1e4))

    def tune(self):
        """The Ray Tune domain it is."""
        from ray import tune  # the Prefect side builds no search

        if self.choice is not None:
            return tune.choice(self.choice)
        return tune.loguniform(*self.loguniform) if self.loguniform else tune.uniform(*self.uniform)


class SweepConfig(Strict):
    """The search: its space, its trials, and what picks the best."""

    # The default searches the learning rate around the run's default (2e-4), the field that moved
    # validation accuracy most here (see TrainConfig.learning_rate).
    space: dict[str, dict[str, Distribution]] = Field(
        default_factory=lambda: {"train": {"learning_rate": Distribution(loguniform=(5e-5, 5e-4))}},
        description="A distribution per train.* field, e.g. {train.learning_rate: {loguniform: [1e-5, 5e-4]}, "
        "train.epochs: {choice: [1, 2, 3]}}.",
    )
    trials: int = Field(
        8, ge=1, description="Configurations drawn from the space, each trained as a run's train stage."
    )
    concurrent: int = Field(
        1,
        ge=1,
        description="Trials training at once; each takes the workers its train.* plan asks for, so give them room "
        "(e.g. train.num_workers=1 with train.cpus_per_worker).",
    )
    metric: Monitor = Field(
        "val_accuracy", description="The validation metric that ranks trials and the scheduler acts on."
    )
    mode: Literal["max", "min"] | None = Field(None, description="Default: max for val_accuracy, min for val_loss.")
    scheduler: Literal["asha", "none"] = Field(
        "asha",
        description="asha: stop trials whose metric trails the others' at the same evaluation (Ray Tune's ASHA); "
        "none: every trial trains to its end.",
    )
    grace_period: int = Field(1, ge=1, description="ASHA: evaluations every trial is given before it may be stopped.")
    # Ray Tune's default and the ASHA paper's: at 2, half the trials reached each next rung, and on 8 trials
    # the sweep took 0.55-0.76x the scheduler-less one's time (bench/RESULTS.md).
    reduction_factor: int = Field(4, ge=2, description="ASHA: 1 in this many trials goes on at each rung.")
    seed: int = Field(0, description="Of the draws from the space: the same seed draws the same configurations.")

    @field_validator("space", mode="before")
    @classmethod
    def _dotted(cls, given: Any) -> Any:
        """`train.learning_rate: {...}` as a YAML key or a --set path: the same as `train: {learning_rate: {...}}`."""
        if not isinstance(given, dict):
            return given
        nested: dict[str, Any] = {}
        for key, value in given.items():
            section, dot, name = str(key).partition(".")
            nested.setdefault(section, {}).update({name: value} if dot else value)
        return nested

    @model_validator(mode="after")
    def _searchable(self) -> SweepConfig:
        if unknown := sorted(set(self.space) - {"train"}):
            raise ValueError(f"space: {unknown[0]}.*: only train.* fields can be searched")
        if not self.space.get("train"):
            raise ValueError("space is empty: give a distribution for at least one train.* field")
        if self.mode and self.mode != BETTER[self.metric]:
            raise ValueError(f"mode={self.mode} for {self.metric}: it is better {BETTER[self.metric]}imized")
        return self

    @property
    def direction(self) -> str:
        return self.mode or BETTER[self.metric]

    def fields(self) -> dict[str, Distribution]:
        return self.space["train"]


class SweepParams(FinetuneParams):
    """A sweep: a run's parameters (each trial trains as the run's train stage would, with the searched
    train.* fields drawn) and the search."""

    sweep: SweepConfig = SweepConfig()

    @model_validator(mode="after")
    def _space_fits_training(self) -> SweepParams:
        """Every searched field is a train.* field (the closest named where not), and every point the
        check tries is one TrainConfig takes with the run's other train.* fields; a choice's values are
        then held as TrainConfig holds them. A search over lora.* trains LoRA: train.lora defaults where unset."""
        if self.train.lora is None and any(name.startswith("lora.") for name in self.sweep.fields()):
            self.train = self.train.model_copy(update={"lora": Lora()})
        base = self.train.model_dump()
        for name, distribution in self.sweep.fields().items():
            taken = []
            for point in distribution.points():
                try:
                    cfg = TrainConfig.model_validate(with_drawn(base, {name: point}))
                    taken.append(reduce(getattr, name.split("."), cfg))
                except ValidationError as error:
                    raise ValueError(f"sweep.space.train.{name}: {point!r}: {one_line(error)}") from None
            if distribution.choice is not None:
                # as the field holds them: YAML reads 1e-4 as the string "1e-4" (1.0e-4 is a float), which
                # TrainConfig takes as a number, but the trials' table and plot got a string
                distribution.choice = taken
        return self

    @model_validator(mode="after")
    def _trials_watch_the_metric(self) -> SweepParams:
        """Each trial's keep_best and early stopping watch the metric that ranks the trials (train.monitor
        says so): a best checkpoint by another metric would not be the one its trial was ranked by. Not
        refused when they differ: the UI's form sends every train.* field, its default monitor too.
        A task's default metric is its own (val_loss for regression, val_entity_f1 for token_classification)."""
        metric = task_monitor(
            self.data.task, self.sweep.metric, "metric" in self.sweep.model_fields_set, "sweep.metric"
        )
        if metric != self.sweep.metric:
            self.sweep = self.sweep.model_copy(update={"metric": metric})
        self.train = self.train.model_copy(update={"monitor": self.sweep.metric})
        return self


def with_drawn(train: dict, drawn: dict[str, Any]) -> dict:
    """train.* fields with a trial's drawn values, a dotted name (lora.r) setting a section's field."""
    fields = dict(train)
    for name, value in drawn.items():
        section, dot, field = name.partition(".")
        fields[section] = {**fields[section], field: value} if dot else value
    return fields
