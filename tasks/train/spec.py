"""What training's driver tells its workers, typed: the Plan and the WorkerSpec every worker gets, and
the Progress a checkpoint holds for resume. What training hands the other stages (its Result, beside
the exported model) is tasks/contracts/training.py. Imports no Prefect, Ray or torch."""

from __future__ import annotations

import hashlib
import math

from pydantic import BaseModel

from tasks.contracts.training import Curve, EpochRecord, WorkerGroup
from tasks.core.model_config import ModelInit
from tasks.core.targets import Targets
from tasks.core.train_config import TrainConfig


class Plan(BaseModel, frozen=True):
    """How a TrainConfig lands on the cluster (tasks/train/plan.py `plan_of`)."""

    workers: int
    cpus_per_worker: float
    micro_batch: int
    accumulation: int
    use_gpu: bool
    precision: str  # fp32, fp16, bf16, or auto (bf16 where the GPU has it, else fp16)

    def describe(self, cfg: TrainConfig) -> str:
        device = "GPU" if self.use_gpu else "CPU"
        workers = f"{cfg.num_workers[0]}-{self.workers}" if isinstance(cfg.num_workers, tuple) else self.workers
        return (
            f"{workers} {device} worker(s) of {self.cpus_per_worker:g} CPU"
            f" x micro-batch {self.micro_batch} x accumulation {self.accumulation}"
            f" = global batch {self.global_batch}, ZeRO-{cfg.zero_stage}, {self.precision}"
        )

    @property
    def global_batch(self) -> int:
        return self.workers * self.micro_batch * self.accumulation

    def at(self, workers: int, batch_size: int) -> Plan:
        """The plan for a worker group of another size (a range of num_workers): the same micro-batch, and
        the accumulation that keeps the global batch, or the nearest where `workers` does not divide it."""
        accumulation = max(1, round(batch_size / (workers * self.micro_batch)))
        return self.model_copy(update={"workers": workers, "accumulation": accumulation})


class WorkerSpec(BaseModel):
    """All a worker is told: the typed config, its plan, the DeepSpeed JSON, and where the model goes."""

    train: TrainConfig
    plan: Plan
    deepspeed: dict
    model: str
    init: ModelInit  # the model's weights: the saved ones, or drawn from its config (ModelConfig.init)
    targets: Targets  # what the model outputs: classes, labels or numbers
    max_length: int
    train_uri: str  # the training split's shards (a worker reads the rest of an epoch itself: passes.py)
    train_rows: int  # the training split's rows (a long text's windows each counted)
    batches_per_epoch: int  # micro-batches per worker and epoch, the same on every worker
    max_steps: int  # optimizer steps of the whole run
    model_uri: str  # where rank 0 writes the consolidated model
    adapter_uri: str  # where rank 0 writes the LoRA adapter alone (train.lora)
    # the shards of validation, and of the test split where there is one: the trained engine labels it (Result.test)
    evaluation: dict[str, str] = {}
    channel: str | None = None  # the driver's progress channel (tasks/core/progress.py), once it listens
    # whether a node of the run can be preempted: on a cluster, not on ftflow's local Ray, whose nodes
    # Ray Train's watcher then does not poll and whose workers ask no one (tasks/train/preemption.py)
    preemptible: bool = False
    digest: str = ""  # digest_of this spec, set by the driver; the export's Result keeps it


def digest_of(spec: WorkerSpec) -> str:
    """What the spec asks, as a digest: its progress channel (one per attempt) and its own digest aside."""
    return hashlib.sha256(spec.model_dump_json(exclude={"channel", "digest"}).encode()).hexdigest()


def at_world_size(spec: WorkerSpec, workers: int) -> WorkerSpec:
    """The spec for a worker group of `workers` (Ray Train's elastic groups change size): its plan, its
    DeepSpeed micro-batch and accumulation, and its micro-batches per epoch (the split padded to a
    multiple of the workers)."""
    if workers == spec.plan.workers:
        return spec
    plan = spec.plan.at(workers, spec.train.batch_size)
    deepspeed = spec.deepspeed | {
        "train_batch_size": plan.global_batch,
        "gradient_accumulation_steps": plan.accumulation,
    }
    batches = math.ceil(math.ceil(spec.train_rows / workers) / plan.micro_batch)
    return spec.model_copy(update={"plan": plan, "deepspeed": deepspeed, "batches_per_epoch": batches})


class Progress(BaseModel):
    """Where training stands, saved in every checkpoint and read back on resume: a resumed run has
    every epoch and every curve point once."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    # the split's rows of the next epoch already trained, on every worker (padding not counted); their
    # keys are beside it (tasks/train/passes.py), so the epoch goes on at any number of workers
    rows_done: int = 0
    world_size: int | None = None  # the workers that trained it (None: saved before ftflow recorded it)
    groups: list[WorkerGroup] = []  # each number of workers that trained, from the step it resumed at
    history: list[EpochRecord] = []
    curve: Curve = Curve()

    def trained_by(self, workers: int) -> Progress:
        """This progress with a group of `workers` training on from its step, where the size changed."""
        if self.groups and self.groups[-1].workers == workers:
            return self
        return self.model_copy(update={"groups": [*self.groups, WorkerGroup(from_step=self.step, workers=workers)]})
