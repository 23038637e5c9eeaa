"""Stage 2, the worker side: what every Ray Train worker runs, a DeepSpeed engine fed by its shard of
the streamed tokenized splits. The driver side (plan, DeepSpeed JSON, the Prefect task) is
tasks/train.py; this module imports no Prefect, so workers start without it.

The loop is ours (not the HF Trainer) so that the DeepSpeed engine, its ZeRO stage and its
checkpoints stay visible and configurable; transformers still does all model I/O.

What a worker sees of the data: Ray Data streams each split from its Parquet shards, and Ray Train
splits the stream into equal parts, one per worker (`get_dataset_shard`). The driver pads each split
with fewer ignored rows than there are workers, so the equal split drops no row and every worker
runs the same number of micro-batches. The training split is shuffled once by Ray Data with the
seed (the same permutation every epoch), then within a buffer of `shuffle_buffer_rows` rows with a
seed of (seed, epoch, worker): the order of every epoch follows from the seed alone. Rows are then
drawn `length_group_batches` micro-batches at a time, sorted by length, cut into micro-batches and
trained in a seeded random order (most of a batch's padding was compute spent on nothing). A worker
holds its group, `prefetch_batches` more and the shuffle buffer, whatever the corpus size.
"""

from __future__ import annotations

import copy
import logging
import resource
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import timedelta
from itertools import islice
from pathlib import Path

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from pydantic import BaseModel
from ray.experimental import internal_kv
from ray.train import Checkpoint
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
from transformers.integrations.deepspeed import HfDeepSpeedConfig

from tasks import devices, pipeline, storage
from tasks.config import TrainConfig, hub_free
from tasks.first_token import last_layer_at_first_token
from tasks.pipeline import IGNORED, mean_loss
from tasks.predictor import padded
from tasks.progress import NAMESPACE, Tick, post, say
from tasks.strategy import Choice
from tasks.watch import TRAINING, Pulse

STATE_FILE = "training_state.json"  # beside the exported model: the history, the curve, the validation predictions


class Plan(BaseModel, frozen=True):
    """How a TrainConfig lands on the cluster (tasks/train.py `plan`)."""

    workers: int
    cpus_per_worker: float
    micro_batch: int
    accumulation: int
    use_gpu: bool
    precision: str  # fp32, fp16, bf16, or auto (bf16 where the GPU has it, else fp16)

    def describe(self, cfg: TrainConfig) -> str:
        device = "GPU" if self.use_gpu else "CPU"
        return (
            f"{self.workers} {device} worker(s) of {self.cpus_per_worker:g} CPU"
            f" x micro-batch {self.micro_batch} x accumulation {self.accumulation}"
            f" = global batch {cfg.batch_size}, ZeRO-{cfg.zero_stage}, {self.precision}"
        )


class WorkerSpec(BaseModel):
    """All a worker is told: the typed config, its plan, the DeepSpeed JSON, and where the model goes."""

    train: TrainConfig
    plan: Plan
    deepspeed: dict
    model: str
    label_names: list[str]
    max_length: int
    batches_per_epoch: int  # micro-batches per worker and epoch, the same on every worker
    max_steps: int  # optimizer steps of the whole run
    model_uri: str  # where rank 0 writes the consolidated model


class Fault(BaseModel):
    """A fault the tests inject (FTFLOW_TEST_FAULT, as JSON, read by the driver): at optimizer step
    `step`, worker `rank` raises, or with hang_s waits that long, once per run."""

    step: int
    rank: int = 0
    hang_s: float = 0.0


class Point(BaseModel):
    step: int
    epoch: float
    loss: float
    accuracy: float


class Curve(BaseModel):
    """Loss and accuracy per optimizer step, for the run report's plots: training averaged over the
    rows of every `log_every_steps` steps on all workers, validation at each evaluation."""

    train: list[Point] = []
    validation: list[Point] = []


class EpochRecord(BaseModel):
    epoch: float  # epochs done at this record: whole, unless max_steps ended the run mid-epoch
    step: int
    resumed_from_step: int
    train_loss: float
    val_loss: float
    val_accuracy: float
    samples_per_s: float  # steady state: after the first micro-batch, evaluations and checkpoints excluded
    peak_memory_mb: float  # the largest over workers
    startup_s: float | None  # this attempt's model load, engine build and first micro-batch, in its first epoch only
    checkpoint_s: float | None  # mean seconds per mid-epoch checkpoint


class Progress(BaseModel):
    """Where training stands, saved in every checkpoint and read back on resume: a resumed run has
    every epoch and every curve point once."""

    epoch: int = 0  # epochs completed
    batches_done: int = 0  # micro-batches of the next epoch already trained
    history: list[EpochRecord] = []
    curve: Curve = Curve()


class Result(BaseModel):
    """What training leaves beside the model (STATE_FILE)."""

    history: list[EpochRecord]
    curve: Curve
    validation_predictions: list[int]  # by validation row, as the engine predicted them
    nodes: list[str]  # the Ray node of each worker, by rank, in the last attempt
    layer_parameter_mb: float | None = (
        None  # the encoder layers' parameters rank 0 holds: what tensor parallelism and ZeRO-3 split
    )
    first_step_at: float | None = (
        None  # Unix time the last attempt's first micro-batch was done (None: it trained none)
    )
    cluster: dict = {}  # the cluster that trained (tasks/cluster.py describe), added by the driver
    strategy: Choice | None = None  # what strategy=auto chose and why, added by the driver


def collate(batch: dict[str, np.ndarray], pad_id: int, pin: bool) -> dict[str, torch.Tensor]:
    """A Ray Data batch of tokenized rows -> padded host tensors (row numbers kept, for validation),
    in page-locked memory for a GPU, so that their copy to it runs beside the compute."""
    rows = list(batch["input_ids"])
    input_ids, attention_mask = padded(rows, np.fromiter(map(len, rows), np.int64, len(rows)), pad_id)
    host = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.tensor(batch["label"], device="cpu"),
        "row": torch.tensor(batch["row"], device="cpu"),
    }  # copies: Ray's arrays are read-only
    return {key: tensor.pin_memory() for key, tensor in host.items()} if pin else host


def on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)  # from pinned memory: asynchronous, in order on the stream


def by_length(group: list[dict[str, np.ndarray]], pad_id: int, pin: bool) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of rows -> as many micro-batches of the same sizes, of the same rows sorted by
    length (shortest first), each padded to its own longest row."""
    rows = {key: np.concatenate([batch[key] for batch in group]) for key in group[0]}
    order = np.argsort(np.fromiter(map(len, rows["input_ids"]), np.int64, len(rows["input_ids"])), kind="stable")
    ends = np.cumsum([len(batch["row"]) for batch in group])
    return [
        collate({key: column[part] for key, column in rows.items()}, pad_id, pin) for part in np.split(order, ends[:-1])
    ]


def batches(
    split: str, micro_batch: int, cfg: TrainConfig, pad_id: int, epoch: int | None = None, *, pin: bool = False
):
    """This worker's micro-batches of a split for one pass, `length_group_batches` at a time grouped by
    length. For an epoch of training, rows come from a seeded shuffle buffer and each group's batches
    go in an order drawn from (seed, epoch) alone: the same on every worker, so the workers' batches
    at one step are of like width (a step waits for its slowest worker)."""
    rank = ray.train.get_context().get_world_rank()
    shuffle = (
        {}
        if epoch is None
        else {
            "local_shuffle_buffer_size": cfg.shuffle_buffer_rows,
            "local_shuffle_seed": hash((cfg.seed, epoch, rank)) % 2**32,
        }
    )
    order = None if epoch is None else np.random.default_rng([cfg.seed, epoch])
    drawn = iter(
        ray.train.get_dataset_shard(split).iter_batches(
            batch_size=micro_batch, batch_format="numpy", prefetch_batches=cfg.prefetch_batches, **shuffle
        )
    )
    # Grouped here rather than by asking Ray for batches of the group's size: its shuffle buffer then
    # yielded a short batch mid-stream (22 micro-batches on one worker, 21 on the others).
    for group in iter(lambda: list(islice(drawn, cfg.length_group_batches)), []):
        grouped = by_length(group, pad_id, pin)  # every worker draws as many micro-batches, so as many per group
        yield from grouped if order is None else (grouped[i] for i in order.permutation(len(grouped)))


def logits_of(engine, batch: dict, device: torch.device) -> torch.Tensor:
    return engine(input_ids=on(device, batch["input_ids"]), attention_mask=on(device, batch["attention_mask"])).logits


def forward(engine, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss over the batch's real rows, logits, labels); padding rows count for nothing."""
    labels, logits = on(device, batch["labels"]), logits_of(engine, batch, device)
    return mean_loss(logits, labels), logits, labels


class Replica:
    """The workers that hold one copy of the model between them, and how that copy trains and
    predicts. A tensor-parallel group splits every layer's matrices, so its ranks compute on the same
    rows; a pipeline's first stage needs the rows and its last the labels. Either way each rank still
    reads its own share of the data (Ray's split is unchanged) and the replica joins its ranks'
    micro-batches into one: the global batch stays micro-batch x accumulation x workers. The rank
    that holds the logits speaks for the replica in the metrics (the first of a tensor-parallel
    group, a pipeline's last stage)."""

    def __init__(self, engine, accumulation: int, names: dict[int, str] | None = None, config=None):
        from deepspeed.utils import groups

        self.engine, self.accumulation, self.names, self.config = engine, accumulation, names, config
        self.pending: list[dict] = []  # a pipeline's micro-batches of the step to come
        self.head = pipeline.head(engine) if names is not None else None  # a pipeline's last stage's head
        if names is not None:  # pipeline stages (tasks/pipeline.py)
            self.group, self.leads = engine.grid.get_pipe_parallel_group(), engine.is_last_stage()
        elif engine.autotp_size() > 1:
            self.group, self.leads = (
                groups.get_tensor_model_parallel_group(),
                groups.get_tensor_model_parallel_rank() == 0,
            )
        else:
            self.group, self.leads = None, True

    def join(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
        if self.group is None:
            return batch
        parts: list[dict] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, batch, group=self.group)
        width = max(part["input_ids"].shape[1] for part in parts)
        padding = {"input_ids": pad_id, "attention_mask": 0}
        return {
            key: torch.cat(
                [
                    torch.nn.functional.pad(part[key], (0, width - part[key].shape[1]), value=padding[key])
                    if key in padding
                    else part[key]
                    for part in parts
                ]
            )
            for key in batch
        }

    def train(
        self, batch: dict, device: torch.device, offload: bool, alone
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """Train on a micro-batch; yield (loss, logits or None on ranks without them, labels) of each
        micro-batch computed. A pipeline trains a whole step at once, once its micro-batches are in."""
        if self.names is None:
            # save_on_cpu keeps the tensors autograd saves for backward in host memory until needed.
            with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext(), alone():
                loss, logits, labels = forward(self.engine, batch, device)
                self.engine.backward(loss)
            self.engine.step()  # an optimizer step only at the end of an accumulation cycle
            yield loss, logits, labels
            return
        self.pending.append(batch)
        if len(self.pending) < self.accumulation:
            return
        step, self.pending = self.pending, []
        loss = self.engine.train_batch(iter([self.pipe_inputs(part, device) for part in step]))
        logits = self.head.logits if self.head else [None] * len(step)
        for part, part_logits in zip(step, logits, strict=True):
            yield loss, part_logits, on(device, part["labels"])
        if self.head:
            self.head.logits.clear()

    def logits(self, batch: dict, device: torch.device) -> torch.Tensor | None:
        """Eval-mode logits of a micro-batch, on the ranks that hold them."""
        if self.names is None:
            return logits_of(self.engine, batch, device)
        _, logits = self.engine.eval_batch(
            iter([self.pipe_inputs(batch, device)]), return_logits=True, num_micro_batches=1
        )
        if self.head:
            self.head.logits.clear()
        return logits if self.leads else None

    @staticmethod
    def pipe_inputs(batch: dict, device: torch.device) -> tuple:
        return (on(device, batch["input_ids"]), on(device, batch["attention_mask"])), on(device, batch["labels"])

    def layers(self) -> list[torch.nn.Module]:
        """The encoder layers this worker holds (BERT-family models; none found for others)."""
        if self.names is not None:
            return [
                layer.layer for layer in self.engine.module.forward_funcs if isinstance(layer, pipeline.EncoderLayer)
            ]
        return list(getattr(getattr(self.engine.module.base_model, "encoder", None), "layer", None) or [])

    def exported(self) -> tuple[torch.nn.Module | None, dict | None]:
        """(model, state dict) for rank 0 to save, the whole model gathered from where it is split
        (ZeRO-3, tensor parallelism, pipeline stages): every rank must call it."""
        if self.names is not None:
            return pipeline.consolidated(self.engine, self.names, self.config), None
        split = self.group is not None or self.engine.zero_optimization_partition_weights()
        return self.engine.module, self.engine._consolidated_16bit_state_dict() if split else None


class Meter:
    """Training loss x rows, rows right and rows, summed on the device and read only every
    `log_every_steps` steps: no sync per batch. Also the rows per second between two reads."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.read_at, self.rows_per_s = time.perf_counter(), 0.0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        real = labels != IGNORED
        rows = real.sum().double()
        self.sums += torch.stack(
            [loss.detach().double() * rows, (logits.detach().argmax(-1) == labels)[real].sum().double(), rows]
        )

    def point(self, step: int, epoch: float) -> Point:
        dist.all_reduce(self.sums)
        loss_x_rows, right, rows = self.sums.tolist()
        self.sums.zero_()
        now = time.perf_counter()
        self.read_at, self.rows_per_s = now, rows / (now - self.read_at)
        return Point(step=step, epoch=round(epoch, 4), loss=loss_x_rows / max(rows, 1), accuracy=right / max(rows, 1))


@torch.no_grad()
def validate(
    engine, replica: Replica, spec: WorkerSpec, pad_id: int, device: torch.device
) -> tuple[float, float, list[int]]:
    """Exact loss, accuracy and row-ordered predictions over the whole validation split, gathered
    from all workers (each replica's from the rank that holds its logits); the padding rows are
    dropped by their row number (-1)."""
    engine.eval()
    local: list[tuple[int, float, int, int]] = []
    for batch in batches("validation", spec.plan.micro_batch, spec.train, pad_id, pin=device.type == "cuda"):
        batch = replica.join(batch, pad_id)
        logits = replica.logits(batch, device)
        if not replica.leads:
            continue
        real, labels, logits = batch["row"] >= 0, batch["labels"], logits.float().cpu()
        losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="none")
        local += zip(
            batch["row"][real].tolist(),
            losses[real].tolist(),
            logits.argmax(-1)[real].tolist(),
            labels[real].tolist(),
            strict=True,
        )
    engine.train()  # training may go on mid-epoch
    gathered: list[list] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    rows = sorted(row for part in gathered for row in part)
    return (sum(r[1] for r in rows) / len(rows), sum(r[2] == r[3] for r in rows) / len(rows), [r[2] for r in rows])


def layer_parameter_mb(layers: list[torch.nn.Module]) -> float | None:
    """MiB of the encoder layers' parameters this worker holds (its ZeRO-3 partition, its tensor-parallel
    shards, its pipeline stage's layers); None where it found none."""
    if not layers:
        return None
    return (
        sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for layer in layers for p in layer.parameters())
        / 2**20
    )


def peak_memory_mb(device: torch.device) -> float:
    """The largest peak over workers: accelerator memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB
    worst = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def save(engine, progress: Progress, metrics: dict) -> None:
    """Report a checkpoint from every rank: each writes its own ZeRO shards of the DeepSpeed engine
    state and Ray gathers them into one checkpoint; the progress travels inside it."""
    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder, tag="state", client_state={"progress": progress.model_dump()})
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def resume(engine, channel: str | None) -> Progress:
    """Load the latest checkpoint Ray Train holds for this run (after a worker failure, a task
    retry or a re-run with the same run id) and return its progress, or the start of training."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Progress()
    with checkpoint.as_directory() as folder:
        _, client_state = engine.load_checkpoint(folder, tag="state")
    progress = Progress.model_validate(client_state["progress"])
    if dist.get_rank() == 0 and channel is not None:
        say(
            channel,
            logging.INFO,
            f"rank 0: resumed from the checkpoint at step {engine.global_steps}: epoch {progress.epoch + 1}, "
            f"micro-batch {progress.batches_done}",
        )
    return progress


def export(replica: Replica, tokenizer, spec: WorkerSpec, result: Result) -> None:
    """Rank 0 writes the consolidated HF model folder straight into the run's storage (the driver
    never downloads checkpoint shards); where the parameters are split every rank joins the gather.
    The weights are saved in fp32 whatever the training precision: a bf16 or fp16 engine's weights
    saved as they are would load as a bf16/fp16 model by default, 2.4x slower on a CPU (bf16), and
    evaluation and inference choose their own precision at load."""
    model, weights = replica.exported()
    if dist.get_rank() == 0:
        weights = {
            name: tensor.float() if tensor.is_floating_point() else tensor
            for name, tensor in (weights or model.state_dict()).items()
        }
        config = copy.deepcopy(model.config)
        config.dtype = torch.float32  # transformers takes the saved dtype from the module's parameters
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder, state_dict=weights)
            config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            Path(folder, STATE_FILE).write_text(result.model_dump_json())
            storage.upload_dir(folder, spec.model_uri)
    dist.barrier()


def build_model(spec: WorkerSpec):
    # While this object lives, from_pretrained builds a ZeRO-3 model already partitioned (zero.Init):
    # no worker ever holds the whole model, which is what lets ZeRO-3 fit models that do not fit.
    # transformers 5.23 refuses to load under zero.Init when the config asks for tensor parallelism
    # ("Weight conversions ... not yet implemented"): then each worker loads it whole, and the
    # engine splits it, then partitions its shards.
    partitioned = spec.train.zero_stage == 3 and spec.train.tensor_parallel_size == 1
    zero_init = HfDeepSpeedConfig(spec.deepspeed) if partitioned else None  # noqa: F841 (kept alive)
    names = spec.label_names
    model = AutoModelForSequenceClassification.from_pretrained(
        spec.model,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={name: i for i, name in enumerate(names)},
        **hub_free(spec.model),
    )
    last_layer_at_first_token(model)
    if spec.train.activation_checkpointing and spec.train.pipeline_parallel_size == 1:  # stages checkpoint their own
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def param_groups(model) -> list[dict]:
    """Weight decay for weight matrices only, as BERT-style recipes do."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim > 1]},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]


def join_process_group(device: torch.device, timeout_s: float) -> None:
    """DeepSpeed's view of the process group Ray made (with TorchConfig's timeout); DeepSpeed's own
    groups (ZeRO, tensor and pipeline parallelism) get the same bound instead of its 30 minutes."""
    import deepspeed

    if device.type == "cpu":
        # DeepSpeed builds its shared-memory collective op at every init_distributed on CPU (~30 s of
        # compile on a fresh machine) for DeepSpeed-Inference's all-reduce alone: training's collectives
        # go through torch.distributed. Marked unavailable, it is not built (DeepSpeed keeps this dict).
        # Not on CUDA: there the op does not exist, and reading the dict runs DeepSpeed's op probe,
        # which calls nvcc several times.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
    )


def precision_of(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def resolve_precision(spec: WorkerSpec, device: torch.device) -> WorkerSpec:
    """precision=auto on a GPU (the driver cannot see it): bf16 where the hardware has it, else fp16."""
    if spec.plan.precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        spec = spec.model_copy(
            update={
                "deepspeed": spec.deepspeed
                | {
                    "bf16": spec.deepspeed["bf16"] | {"enabled": precision == "bf16"},
                    "fp16": spec.deepspeed["fp16"] | {"enabled": precision == "fp16"},
                }
            }
        )
    if spec.deepspeed["bf16"]["enabled"] and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision=bf16 but {torch.cuda.get_device_name()} has no bf16: use fp16 or auto")
    return spec


def setup(spec: WorkerSpec, pulse: Pulse) -> tuple:
    """This worker's part: the process group, the tokenizer, the DeepSpeed engine and its replica."""
    import deepspeed  # imported in the worker: it probes the accelerator at import

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames used by DeepSpeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    set_seed(spec.train.seed)
    # The worker's CPU share (1 beside a GPU by default): the host side of a GPU step (collate, the
    # Python loop) is single-threaded, and offloaded optimizer state steps on cpus_per_worker threads.
    torch.set_num_threads(max(1, int(spec.plan.cpus_per_worker)))
    device = ray.train.torch.get_device()
    spec = resolve_precision(spec, device)
    pulse("joining the process group")
    join_process_group(device, spec.train.collective_timeout_s)
    pulse("loading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(spec.model, **hub_free(spec.model))
    tokenizer.model_max_length = spec.max_length  # the exported tokenizer truncates as training did
    pulse("loading the model")
    model = build_model(spec)
    stages = spec.train.pipeline_parallel_size
    module, names = pipeline.stages(model, stages, spec.train.activation_checkpointing) if stages > 1 else (model, None)
    pulse("building the DeepSpeed engine")  # its first collective (broadcasting the weights) is NCCL's first connection
    engine, *_ = deepspeed.initialize(model=module, model_parameters=param_groups(module), config=spec.deepspeed)
    return engine, device, tokenizer, Replica(engine, spec.plan.accumulation, names, model.config)


def engine_line(engine, device: torch.device, seconds: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"rank 0: engine built on {device} ({name}), {precision_of(engine)}, ZeRO-{engine.zero_optimization_stage()}, in {seconds:.1f} s"


def injected(fault: Fault | None, channel: str | None, step: int) -> None:
    """The tests' fault, if this is its worker and step and it has not fired yet in this run."""
    if fault is None or fault.step != step or dist.get_rank() != fault.rank:
        return
    if not internal_kv._internal_kv_put(
        f"{channel}fault", b"fired", overwrite=False, namespace=NAMESPACE
    ):  # False: new key
        if fault.hang_s:
            time.sleep(fault.hang_s)
            return
        raise RuntimeError(
            f"injected fault at step {step}, at {time.time():.3f}"
        )  # when, for the test to time its line


def tick(point: Point, max_steps: int, samples_per_s: float) -> Tick:
    return Tick(
        stage="train",
        done=point.step,
        total=max_steps,
        unit="steps",
        metrics={"loss": point.loss, "accuracy": point.accuracy, "samples_per_s": samples_per_s},
        text=f"epoch {point.epoch:.2f}, loss {point.loss:.4f}, accuracy {point.accuracy:.3f}, {samples_per_s:.1f} samples/s",
    )


def train_worker(config: dict) -> None:
    """A Ray Train worker: the spec, the driver's channel (tasks/progress.py) and the tests' hooks
    from the config, then training, its heartbeats posted (the last one exactly, if it fails)."""
    spec, channel = WorkerSpec.model_validate(config["spec"]), config.get("channel")
    if config.get("check_devices"):
        devices.check_collectives(ray.train.torch.get_device())
    with Pulse(channel, ray.train.get_context().get_world_rank()).beating() as pulse:
        run(spec, channel, pulse, Fault.model_validate(config["fault"]) if config.get("fault") else None)


def run(spec: WorkerSpec, channel: str | None, pulse: Pulse, fault: Fault | None) -> None:
    """Epochs of micro-batches until the last epoch or max_steps, evaluating and checkpointing on the
    steps the config names and at every epoch's end; then rank 0 exports the model.

    Resume: the engine state and the progress come from the last checkpoint; a checkpoint taken
    mid-epoch continues that epoch, reading its first `batches_done` micro-batches again (the same
    ones: the order follows from the seed) and skipping them without computing on them. Nothing is
    trained twice; the dropout masks after the resume differ from an uninterrupted run's.
    """
    started, cfg = time.perf_counter(), spec.train
    engine, device, tokenizer, replica = setup(spec, pulse)
    if dist.get_rank() == 0 and channel is not None:
        say(channel, logging.INFO, engine_line(engine, device, time.perf_counter() - started))
    pulse("resuming")
    progress, pad_id, meter, pin = (
        resume(engine, channel),
        tokenizer.pad_token_id or 0,
        Meter(device),
        device.type == "cuda",
    )
    first_epoch, resumed_from, predictions, first_step_at = progress.epoch, engine.global_steps, None, None
    nodes: list[str] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())

    # A lone worker has no gradient to all-reduce, yet ZeRO-0's backward flattens every gradient into
    # buckets and all-reduces them over a group of one: 5-8% of a MiniLM step here. DeepSpeed's
    # no_sync skips that (ZeRO 1-3 reduce into their partitions and need it).
    alone = engine.no_sync if dist.get_world_size() == 1 and cfg.zero_stage == 0 else nullcontext

    def evaluate(position: float) -> None:
        nonlocal predictions
        pulse("validating", engine.global_steps)
        loss, accuracy, predictions = validate(engine, replica, spec, pad_id, device)
        progress.curve.validation.append(
            Point(step=engine.global_steps, epoch=round(position, 4), loss=loss, accuracy=accuracy)
        )

    for epoch in range(progress.epoch, cfg.epochs):
        if engine.global_steps >= spec.max_steps:
            break
        engine.train()
        done, trained, samples, paused, checkpoint_seconds = progress.batches_done, 0, 0, 0.0, []
        loss_sum = torch.zeros((), device=device)  # on the device: no sync per batch
        first_done = time.perf_counter()
        pulse("waiting for the first batch", engine.global_steps)
        for batch in islice(batches("train", spec.plan.micro_batch, cfg, pad_id, epoch, pin=pin), done, None):
            rows = int((batch["labels"] != IGNORED).sum())  # this worker's, before its replica joins them
            steps_before = engine.global_steps
            for loss, logits, labels in replica.train(
                replica.join(batch, pad_id), device, cfg.activation_offload, alone
            ):
                if replica.leads:
                    meter.add(loss, logits, labels)
                loss_sum += loss.detach().float()
            done, trained = done + 1, trained + 1
            if trained == 1:
                first_done, first_step_at = time.perf_counter(), first_step_at or time.time()
            else:
                samples += rows
            if engine.global_steps == steps_before:
                continue
            step, position, pause_from = engine.global_steps, epoch + done / spec.batches_per_epoch, time.perf_counter()
            pulse(TRAINING, step)
            injected(fault, channel, step)
            if step % cfg.log_every_steps == 0:
                progress.curve.train.append(meter.point(step, position))
                if dist.get_rank() == 0 and channel is not None:
                    post(channel, tick(progress.curve.train[-1], spec.max_steps, meter.rows_per_s))
            last = done == spec.batches_per_epoch or step >= spec.max_steps
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and not last:
                evaluate(position)  # the epoch's end is evaluated below
            if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0 and not last:
                pulse("checkpointing", step)
                save(
                    engine,
                    progress.model_copy(update={"epoch": epoch, "batches_done": done}, deep=True),
                    {"epoch": position, "step": step},
                )
                checkpoint_seconds.append(time.perf_counter() - pause_from)
            paused += time.perf_counter() - pause_from
            if step >= spec.max_steps:
                break
        elapsed = time.perf_counter() - first_done - paused
        totals = torch.tensor([loss_sum.item(), trained, samples], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        whole = done == spec.batches_per_epoch  # else max_steps ended the run mid-epoch
        evaluate(epoch + done / spec.batches_per_epoch)
        progress.history.append(
            EpochRecord(
                epoch=round(epoch + done / spec.batches_per_epoch, 4),
                step=engine.global_steps,
                resumed_from_step=resumed_from,
                train_loss=totals[0].item() / max(totals[1].item(), 1),
                val_loss=progress.curve.validation[-1].loss,
                val_accuracy=progress.curve.validation[-1].accuracy,
                samples_per_s=totals[2].item() / elapsed if elapsed > 0 else 0.0,
                peak_memory_mb=peak_memory_mb(device),
                startup_s=first_done - started if epoch == first_epoch else None,
                checkpoint_s=sum(checkpoint_seconds) / len(checkpoint_seconds) if checkpoint_seconds else None,
            )
        )
        progress = progress.model_copy(
            update={"epoch": epoch + 1 if whole else epoch, "batches_done": 0 if whole else done}
        )
        pulse("checkpointing", engine.global_steps)
        save(engine, progress, progress.history[-1].model_dump())
    if predictions is None:  # a re-run of a finished run trains nothing; its export still needs them
        predictions = validate(engine, replica, spec, pad_id, device)[2]
    pulse("exporting the model", engine.global_steps)
    export(
        replica,
        tokenizer,
        spec,
        Result(
            history=progress.history,
            curve=progress.curve,
            validation_predictions=predictions,
            nodes=nodes,
            layer_parameter_mb=layer_parameter_mb(replica.layers()),
            first_step_at=first_step_at,
        ),
    )
