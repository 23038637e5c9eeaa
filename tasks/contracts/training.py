"""What training takes and hands on, typed: the TrainingJob it is given; rank 0 writes the Result (history, curve, validation and test
predictions, what strategy=auto chose) beside the exported model as STATE_FILE; the driver reads it
back, and evaluation, batch inference, the sweep and the report read it. Imports no Prefect, Ray or
torch."""

from __future__ import annotations

import math

from pydantic import BaseModel

from tasks.contracts.shards import TokenizedSplits
from tasks.core.config import ModelConfig
from tasks.core.layout import RunStore
from tasks.core.scoring import EntityScores, entity_scores
from tasks.core.targets import Targets, Task
from tasks.core.train_config import BETTER, Monitor, TrainConfig


class TrainingJob(BaseModel):
    """One training run's inputs, whole: the flow hands it to the train task (or to the sweep's), they
    to the driver, the driver to each sweep trial (with the trial's fields and folder); every worker's
    WorkerSpec is made of it."""

    shards: TokenizedSplits
    model: ModelConfig
    targets: Targets  # what the model outputs: classes, labels or numbers
    train: TrainConfig
    store: RunStore  # the run's folder: its checkpoints, its model


class Choice(BaseModel):
    """What strategy=auto chose and why, as the run's log and manifest record it."""

    settings: dict  # the TrainConfig fields it set (chosen)
    need_gb: float  # the estimated need per worker of the chosen strategy
    budget_gb: float  # the memory per worker it had
    reason: str


STATE_FILE = "training_state.json"  # beside the exported model: the history, the curve, the validation predictions


class ClusterInfo(BaseModel):
    """The cluster a run trained on, as its manifest records it: the CPUs and GPUs ftflow's stages may take."""

    gcs_address: str
    nodes: int
    cpus: float
    gpus: int


class Point(BaseModel):
    step: int
    epoch: float
    loss: float
    accuracy: float | None = (
        None  # a classifier's (multi-label: every label right; tokens: a token's); regression has none
    )
    entity_f1: float | None = None  # token_classification's validation: entity-level F1 (strict IOB2)

    def value(self, monitor: Monitor) -> float:
        return {"val_accuracy": self.accuracy, "val_entity_f1": self.entity_f1}.get(monitor, self.loss)

    def score(self, monitor: Monitor) -> float:
        """The monitor's value as a score where higher is better (a loss gone NaN or infinite: the lowest)."""
        score = self.value(monitor) if BETTER[monitor] == "max" else -self.value(monitor)
        return score if math.isfinite(score) else UNVALIDATED


class Curve(BaseModel):
    """Loss and accuracy per optimizer step, for the run report's plots: training averaged over the
    rows of every `log_every_steps` steps on all workers, validation at each evaluation."""

    train: list[Point] = []
    validation: list[Point] = []

    def evaluations_since_best(self, monitor: Monitor) -> int:
        """Evaluations after the one with the best monitor value (the first of equals): what early
        stopping counts. Read from the curve, which every checkpoint holds, so a resumed run counts on
        where it stopped."""
        scores = [point.score(monitor) for point in self.validation]
        return len(scores) - 1 - scores.index(max(scores)) if scores else 0


class WorkerGroup(BaseModel):
    """A worker group that trained, from the step it resumed at: a range of num_workers resizes, and a run
    resumed at another number of workers."""

    from_step: int
    workers: int


class EpochRecord(BaseModel):
    epoch: float  # epochs done at this record: whole, unless max_steps ended the run mid-epoch
    step: int
    resumed_from_step: int
    # the worker group that trained since resumed_from_step (a run resumed at another size, or restarted
    # on the nodes a preemption left); None: recorded before ftflow kept it
    workers: int | None = None
    # the split's rows trained in this epoch, across its attempts, on every worker (padding not counted):
    # a whole epoch's are the split's rows, each once; None: recorded before ftflow counted them
    rows: int | None = None
    train_loss: float
    val_loss: float
    val_accuracy: float | None
    val_entity_f1: float | None = None  # token_classification's
    samples_per_s: float  # steady state: after the first micro-batch, evaluations and checkpoints excluded
    peak_memory_mb: float  # the largest over workers
    startup_s: float | None  # this attempt's model load, engine build and first micro-batch, in its first epoch only
    checkpoint_s: float | None  # mean seconds per mid-epoch checkpoint


# The metric every checkpoint reports for Ray Train to rank it by (keep_best): the monitor's score at
# that step (score()), or UNVALIDATED for a scheduled checkpoint no evaluation fell on (below every
# score, so Ray Train drops those first; it always keeps the latest, for resume). Finite: Ray Train's
# checkpoint snapshot writes -inf as null, which a resumed run's checkpoint manager cannot rank.
SCORE = "kept_score"
UNVALIDATED = -1e300


class Kept(BaseModel):
    """The step whose model training exported: its evaluation there, and why."""

    validation: Point
    reason: str

    @property
    def step(self) -> int:
        return self.validation.step


class Marks(BaseModel):
    """When rank 0 of the last attempt reached each point of its run (Unix time; NTP keeps nodes within
    milliseconds of the driver): the run's phases in its manifest are the gaps between them."""

    started: float  # the training function began: its process was up, with its imports
    engine_built: float | None = None  # process group, tokenizer, model and DeepSpeed engine ready
    first_batch: float | None = None  # its first micro-batch came out of the data pipeline
    first_step: float | None = None  # its first micro-batch was trained (None: it trained none)
    last_step: float | None = None  # its last optimizer step was taken
    test_labelled: float | None = None  # after the last validation and checkpoint, the test split labelled


class Predictions(BaseModel):
    """A split as the trained engine predicted it, by row. Evaluation and the test split's batch
    inference read these instead of loading the exported model again in new processes (8.3 + 9.8 s of a
    20-step main job on this CPU). single_label: each row's class id, its probability, the true class id;
    multi_label: each label's probability and the true labels (multi-hot); regression: the predicted and
    the true numbers; token_classification: each word's predicted tag id and its true one."""

    task: Task = "single_label"
    labels: list[int] = []
    scores: list[float] = []
    truth: list[int] = []
    outputs: list[list[float]] = []
    targets: list[list[float]] = []
    tags: list[list[int]] = []
    gold: list[list[int]] = []

    @classmethod
    def of(cls, task: Task, outputs: list[list[float]], targets: list) -> Predictions:
        """From each row's outputs (tasks/core/objective.py outputs_of) and its target."""
        if task != "single_label":
            return cls(task=task, outputs=outputs, targets=targets)
        best = [max(range(len(row)), key=row.__getitem__) for row in outputs]
        return cls(labels=best, scores=[row[i] for row, i in zip(outputs, best, strict=True)], truth=targets)

    @property
    def rows(self) -> int:
        return len(self.labels) or len(self.outputs) or len(self.gold)

    @property
    def accuracy(self) -> float | None:
        """The share of rows right: its class, or every label at 0.5 (subset accuracy); of words with their
        tag (token_classification); None for numbers."""
        if self.task == "token_classification":
            pairs = [
                (p, t) for row, truth in zip(self.tags, self.gold, strict=True) for p, t in zip(row, truth, strict=True)
            ]
            return sum(p == t for p, t in pairs) / max(1, len(pairs))
        if self.task == "single_label":
            return sum(a == b for a, b in zip(self.labels, self.truth, strict=True)) / max(1, len(self.labels))
        if self.task == "multi_label":
            right = [
                all((p > 0.5) == (t > 0.5) for p, t in zip(row, truth, strict=True))
                for row, truth in zip(self.outputs, self.targets, strict=True)
            ]
            return sum(right) / max(1, len(right))
        return None

    def entity_scores(self, names: tuple[str, ...]) -> EntityScores:
        """token_classification: entity-level precision, recall and F1 (tasks/core/scoring.py)."""
        return entity_scores(
            [[names[i] for i in row] for row in self.gold], [[names[i] for i in row] for row in self.tags]
        )


class Result(BaseModel):
    """What training leaves beside the model (STATE_FILE)."""

    history: list[EpochRecord]
    curve: Curve
    validation: Predictions  # the validation split, by row, as the engine predicted it at the kept step
    test: Predictions | None = None  # the test split, where the driver gave one (WorkerSpec.evaluation)
    nodes: list[str]  # the Ray node of each worker, by rank, in the last attempt
    groups: list[WorkerGroup] = []  # each number of workers the run trained with, in turn
    layer_parameter_mb: float | None = (
        None  # the encoder layers' parameters rank 0 holds: what tensor parallelism and ZeRO-3 split
    )
    parameters: int | None = None  # the model's, a ZeRO-3 partition at its full size, a split model's on rank 0
    trained_parameters: int | None = None  # those the optimizer stepped: fewer than parameters under LoRA
    marks: Marks | None = None  # when the last attempt reached each point
    cluster: ClusterInfo | None = None  # the cluster that trained, added by the driver
    strategy: Choice | None = None  # what strategy=auto chose and why, added by the driver
    stopped: str = ""  # why training ended: its epochs, max_steps, or early stopping
    kept: Kept | None = None  # the step exported: the best validated (keep_best), else the last
    # multi-label: each label's decision threshold, tuned on the validation split (THRESHOLD where it has
    # no row with the label), which the exported model keeps in its config as `label_thresholds`
    thresholds: list[float] | None = None
    # the WorkerSpec that trained it (spec.digest_of): a re-run of the same finished spec is this Result
    spec_digest: str = ""
