"""The training section of the parameters, TrainConfig: every DeepSpeed memory and speed feature,
checked as a whole (strategy=auto's fields, the raw DeepSpeed keys, the global batch's split)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field, model_validator

from tasks.core.strict import DEVICE, Device, Strict

# The fields strategy=auto sets (tasks/train/strategy.py).
AUTO_CHOOSES = ("zero_stage", "offload_optimizer", "offload_params", "tensor_parallel_size", "pipeline_parallel_size")


# The validation metrics training reports at each evaluation, and which way is better.
Monitor = Literal["val_accuracy", "val_loss", "val_entity_f1"]
BETTER: dict[str, Literal["max", "min"]] = {"val_accuracy": "max", "val_loss": "min", "val_entity_f1": "max"}
# What each task's evaluations measure (its accuracy is a token's for token_classification), its default first.
MONITORS: dict[str, tuple[Monitor, ...]] = {
    "single_label": ("val_accuracy", "val_loss"),
    "multi_label": ("val_accuracy", "val_loss"),
    "regression": ("val_loss",),
    "token_classification": ("val_entity_f1", "val_accuracy", "val_loss"),
}


def task_monitor(task: str, monitor: Monitor, given: bool, field: str) -> Monitor:
    """The monitor a task's run watches: the one given (`given`: set by the user, not a default), which
    the task must measure, else the task's default."""
    if not given:
        return MONITORS[task][0]
    if monitor not in MONITORS[task]:
        raise ValueError(f"{field}: {monitor}, but data.task {task} measures {', '.join(MONITORS[task])}")
    return monitor


class Lora(Strict):
    """LoRA (peft): low-rank adapters beside the model's linear layers train, the rest stays frozen; the new
    classifier (and any module the checkpoint did not have, as DeBERTa's pooler) trains in full."""

    r: int = Field(8, ge=1, description="The rank of each adapter (its two matrices are r x in and out x r).")
    alpha: float = Field(16, gt=0, description="The adapters' scale: their output is multiplied by alpha / r.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on each adapter's input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="The linear layers to adapt, by their names in the model (query, value; q_proj, v_proj; a "
        "dotted path's end); all-linear: every attention and MLP projection (peft's), the classifier excepted.",
    )


class TrainConfig(Strict):
    """Training, with every DeepSpeed memory and speed feature; tasks/train/driver.py derives the DeepSpeed JSON."""

    num_workers: int | tuple[int, int] | None = Field(
        None,
        description="Ray Train workers, a request the cluster is asked to satisfy (an autoscaler "
        "adds nodes for it); default: one per GPU, else one per cpus_per_worker CPUs, it has now. A range "
        "[min, max]: elastic, the run starts once min are placed, goes on with fewer when a node is lost and "
        "grows toward max as nodes come, each time from the latest checkpoint, with the same global batch.",
    )
    grow_every_s: float = Field(
        60, gt=0, description="With a range of num_workers: how often the run looks for room to grow (Ray's 60 s)."
    )
    device: Device = Field("auto", description=DEVICE)
    cpus_per_worker: float | None = Field(
        None,
        gt=0,
        description="CPUs per worker (torch threads: its whole part, at least 1); default: "
        "on one machine's CPUs all it gives ftflow (shared among num_workers when "
        "set), else 1.",
    )
    strategy: Literal["manual", "auto"] = Field(
        "manual",
        description="auto: ftflow sets zero_stage, offload, tensor_parallel_size and pipeline_parallel_size to the fastest strategy whose "
        "estimated memory fits a worker (memory_per_worker_gb), and logs and records why; manual: as set here.",
    )
    memory_per_worker_gb: float | None = Field(
        None,
        gt=0,
        description="For strategy=auto: the memory one worker may use; default: "
        "its GPU's, or on CPUs its share of its node's memory.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="DeepSpeed ZeRO: 0 replicates the model (fastest while it fits: 16 bytes per fp32 parameter); "
        "1 shards optimizer state, 2 also gradients, 3 also parameters (less memory, slower).",
    )
    offload_optimizer: bool = Field(
        False, description="Keep optimizer state in CPU memory (DeepSpeedCPUAdam); ZeRO 1-3."
    )
    offload_params: bool = Field(False, description="Keep parameters in CPU memory between uses; ZeRO 3 only.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Workers that split every encoder layer's matrices between them (DeepSpeed "
        "AutoTP), for a model too large for one worker: the workers are this x data-"
        "parallel replicas, and each group of this many is placed on one node.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages the model is cut into, one per worker, with as many encoder "
        "layers each (DeepSpeed's pipeline engine; embeddings with the first, the "
        "classifier with the last), fed with micro-batches: the workers are this x "
        "data-parallel replicas. ZeRO 0-1.",
    )
    lora: Lora | None = Field(
        None, description="Train LoRA adapters instead of every weight (tasks/train/lora.py); None: full fine-tuning."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass instead of storing them."
    )
    activation_offload: bool = Field(False, description="Move saved activations to CPU memory (GPU only).")
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")
    export_precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="The exported model's weights. auto: fp32 (what transformers loads by default, fastest on "
        "CPUs) below 1B parameters or where training ran in fp32; else the training's 16-bit precision, half "
        "the disk and the host memory (a 30B model's fp32 export is 120 GB).",
    )
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many optimizer steps (the learning-rate schedule ends there too); "
        "default: every step of every epoch.",
    )
    batch_size: int = Field(32, ge=1, description="Global batch: micro_batch_size x gradient accumulation x workers.")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Per worker and step; default: batch_size / workers (no accumulation)."
    )
    # 2e-4 by validation accuracy, all-MiniLM-L6-v2 on Rotten Tomatoes, 1 epoch, seeds 42 and 1:
    # 0.8330 and 0.8180 (1e-4: 0.8189 and 0.8236; 5e-5: 0.8133; 3e-4: 0.8236, seed 42 only).
    learning_rate: float = Field(
        2e-4, gt=0, description="Peak learning rate, after linear warm-up; then linear decay to 0."
    )
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0, description="AdamW decay of weight matrices (not of biases and norms).")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 disables it.")
    seed: int = 42
    log_every_steps: int = Field(
        10,
        ge=1,
        description="Training loss and accuracy are averaged over every N optimizer steps for the report's curve.",
    )
    eval_every_steps: int = Field(
        100, ge=0, description="Also evaluate on the validation split every N optimizer steps (0: at epoch ends only)."
    )
    checkpoint_every_steps: int = Field(
        0, ge=0, description="Also checkpoint the DeepSpeed state every N optimizer steps (0: at epoch ends only)."
    )
    monitor: Monitor = Field(
        "val_accuracy",
        description="The validation metric early stopping and keep_best watch: the higher accuracy or entity F1, "
        "or the lower loss, is better (a sweep's trials watch sweep.metric instead). Default: val_accuracy; "
        "val_loss for regression, val_entity_f1 for token_classification.",
    )
    early_stopping_patience: int | None = Field(
        None,
        ge=1,
        description="Stop training after N evaluations in a row without a better monitor value than the best so far "
        "(evaluations: every eval_every_steps and at epoch ends); None: train every epoch.",
    )
    # On by default: what evaluation scores, the gate promotes and inference labels is the model
    # validation picked, not whichever step training happened to end on (an epoch that overfits, or the
    # evaluations early stopping waited through). It costs a checkpoint at each new best evaluation
    # between scheduled ones, and a checkpoint load at the end when the best was not the last step.
    keep_best: bool = Field(
        True,
        description="Export (and evaluate, promote, label with) the checkpoint with the best monitor value (of equals "
        "the later), not the last step's: each new best evaluation is checkpointed; false: the last step's.",
    )
    shuffle_buffer_rows: int = Field(
        2048,
        ge=1,
        description="Training rows a worker shuffles among each epoch, after one seeded shuffle of the whole split.",
    )
    length_group_batches: int = Field(
        50,
        ge=1,
        description="Length grouping: the rows of this many micro-batches are drawn at a time, "
        "sorted by length and cut into micro-batches that train in a seeded random "
        "order, so a batch pads little (as the HF Trainer's group_by_length); 1: off.",
    )
    prefetch_batches: int = Field(
        1,
        ge=0,
        description="Micro-batches a worker prepares ahead: with its length group and the shuffle buffer, "
        "what its data costs in memory, whatever the corpus size.",
    )
    wait_for_workers_s: float = Field(
        600,
        gt=0,
        description="How long the cluster may take to make room for every worker "
        "(nodes to start) before the run fails saying what did not come.",
    )
    max_failures: int = Field(2, ge=0, description="Worker failures survived by restarting from the last checkpoint.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail training that runs longer than this, workers stopped "
        "(the same run_id again resumes from its last checkpoint); default: none.",
    )
    stall_warning_s: float | None = Field(
        None,
        gt=0,
        description="When no worker has shown progress for this long, write a stall "
        "report (stacks of every worker, GPUs, the cluster) under the run's "
        "stall/ and warn; the run goes on. Default: 300 s, then 20 x the "
        "recent step time (at least 30 s) once steps flow.",
    )
    collective_timeout_s: float = Field(
        600,
        gt=0,
        description="How long a collective (all-reduce, broadcast) waits for every worker "
        "before the workers fail and Ray Train retries them (Ray's default: 30 min).",
    )
    deepspeed: dict = Field(
        {},
        description="Raw DeepSpeed JSON merged over the derived one, for experts; a key derived from a "
        "field above (zero_optimization.stage, bf16, batch sizes, ...) is refused: set the field.",
    )

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        # Against the defaults, not the fields given: a form (the UI's, a deployment's) sends every field.
        chosen = [
            f"{name}={getattr(self, name)}"
            for name in AUTO_CHOOSES
            if getattr(self, name) != type(self).model_fields[name].default
        ]
        if self.strategy == "auto" and chosen:
            raise ValueError(
                f"strategy=auto chooses {', '.join(AUTO_CHOOSES)}, and {', '.join(chosen)} was set too: leave it out, "
                "or set strategy=manual"
            )
        if self.memory_per_worker_gb and self.strategy != "auto":
            raise ValueError("memory_per_worker_gb is read by strategy=auto only: set strategy=auto, or leave it out")
        if self.pipeline_parallel_size > 1:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "tensor_parallel_size and pipeline_parallel_size cannot both be above 1 (DeepSpeed combines them only "
                    "for Megatron models): choose one"
                )
            if self.zero_stage > 1 or self.offload_optimizer or self.activation_offload:
                raise ValueError(
                    "pipeline_parallel_size needs zero_stage 0 or 1 without offload (DeepSpeed's pipeline engine shards "
                    "neither gradients nor parameters): set zero_stage=1, or pipeline_parallel_size=1"
                )
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                "offload_params needs zero_stage=3 (only stage 3 partitions parameters): set zero_stage=3 or offload_params=false"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3: set zero_stage or offload_optimizer=false")
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size={self.batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}"
            )
        for path in dotted(self.deepspeed):
            if field := next((f for key, f in DERIVED_DEEPSPEED.items() if f"{key}.".startswith(f"{path}.")), None):
                raise ValueError(
                    f"deepspeed.{path} is derived from {field}: set {field} instead (ftflow plans the workers, "
                    "the strategy and the export from it, not from the raw DeepSpeed JSON)"
                )
        return self

    @model_validator(mode="after")
    def _split(self) -> TrainConfig:
        # Given num_workers, the parameters alone decide it: refused here, in a second, not by the plan.
        if isinstance(self.num_workers, tuple):
            return self._range()
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers}: at least 1")
        if self.num_workers and (error := self.split_error(self.num_workers)):
            raise ValueError(error)
        return self

    def _range(self) -> TrainConfig:
        low, high = self.num_workers
        if not 1 <= low <= high:
            raise ValueError(f"num_workers=[{low}, {high}]: a range is [min, max] with 1 <= min <= max")
        if self.model_parallel > 1:
            raise ValueError(
                f"num_workers=[{low}, {high}] with {self.split_field}={self.model_parallel}: a range grows and shrinks "
                "by single workers, not whole model-parallel groups; give a fixed num_workers"
            )
        if error := self.split_error(high):
            raise ValueError(error)
        return self

    @property
    def most_workers(self) -> int | None:
        """num_workers, or the top of its range."""
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def model_parallel(self) -> int:
        """Workers that hold one copy of the model between them: a tensor-parallel group or a pipeline."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def split_field(self) -> str:
        """The field that splits the model, for messages (at most one is above 1)."""
        return "tensor_parallel_size" if self.tensor_parallel_size > 1 else "pipeline_parallel_size"

    def split_error(self, workers: int) -> str | None:
        """What is wrong with `workers` holding whole copies of the model and equal shares of the global
        batch, if anything: checked at validation where num_workers is given, by the plan against the
        cluster otherwise (tasks/train/driver.py)."""
        group = self.model_parallel
        if workers % group:
            return (
                f"num_workers={workers} is not a multiple of {self.split_field}={group}: the workers are groups of "
                f"{group} that hold one copy of the model; use num_workers={max(group, workers - workers % group)} "
                f"or {workers - workers % group + group}"
            )
        micro = self.micro_batch_size or self.batch_size // workers
        if micro < 1 or self.batch_size % (workers * micro):
            return (
                f"batch_size={self.batch_size} is not divisible by {workers} workers x micro_batch_size={micro}; "
                f"use a batch_size that is a multiple of {workers * max(micro, 1)} or change micro_batch_size/num_workers"
            )
        return None


# The DeepSpeed keys tasks/train/driver.py `deepspeed_config` derives from a typed field, and the field: a raw
# override of one would change the engine but not what ftflow reads from the field.
DERIVED_DEEPSPEED = {
    "train_batch_size": "batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "batch_size and micro_batch_size",
    "gradient_clipping": "max_grad_norm",
    "zero_optimization.stage": "zero_stage",
    "zero_optimization.offload_optimizer": "offload_optimizer",
    "zero_optimization.offload_param": "offload_params",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "tensor_parallel.autotp_size": "tensor_parallel_size",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
}


def dotted(tree: dict, prefix: str = "") -> Iterator[str]:
    """The dotted path of every leaf of a nested dict (a value other than a dict)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"
