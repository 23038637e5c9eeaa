"""Stage 2, the worker side: what every Ray Train worker runs, `train_worker`, a DeepSpeed engine
fed by its shard of the streamed tokenized splits (tasks/train/batches.py), trained and validated
through its Replica (tasks/train/replica.py), saved, resumed and exported here. The driver
(tasks/train/driver.py) hands it a WorkerSpec and reads back a Result (tasks/train/contract.py).
This module imports no Prefect and no driver code, so workers start without them.

The loop is ours (not the HF Trainer) so that the DeepSpeed engine, its ZeRO stage and its
checkpoints stay visible and configurable; transformers still does all model I/O.
"""

from __future__ import annotations

import copy
import logging
import resource
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from datetime import timedelta
from itertools import islice
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.experimental import internal_kv
from ray.train import Checkpoint
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
from transformers.integrations.deepspeed import HfDeepSpeedConfig

from tasks.core import storage
from tasks.core.attention import without_cudnn_attention
from tasks.core.config import hub_free
from tasks.core.first_token import last_layer_at_first_token
from tasks.core.progress import NAMESPACE, Tick, post, say
from tasks.train import devices, pipeline
from tasks.train.batches import evaluation_batches, training_batches
from tasks.train.contract import (
    IGNORED,
    STATE_FILE,
    EpochRecord,
    Fault,
    Marks,
    Point,
    Predictions,
    Progress,
    Result,
    WorkerSpec,
)
from tasks.train.replica import Replica
from tasks.train.stream import drawn
from tasks.train.watch import TRAINING, Pulse


class Meter:
    """Training loss x rows, rows right and rows, summed on the device and read only every
    `log_every_steps` steps: no sync per batch. Also the rows per second between two reads."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.read_at, self.rows_per_s = time.perf_counter(), 0.0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        real = labels != IGNORED
        rows, right = real.sum().double(), ((logits.detach().argmax(-1) == labels) & real).sum().double()
        # Not `[real]`: a boolean index sizes its result on the host, a device sync per micro-batch.
        self.sums += torch.stack([loss.detach().double() * rows, right, rows])

    def point(self, step: int, epoch: float) -> Point:
        dist.all_reduce(self.sums)
        loss_x_rows, right, rows = self.sums.tolist()
        self.sums.zero_()
        now = time.perf_counter()
        self.read_at, self.rows_per_s = now, rows / (now - self.read_at)
        return Point(step=step, epoch=round(epoch, 4), loss=loss_x_rows / max(rows, 1), accuracy=right / max(rows, 1))


@torch.no_grad()
def predicted(
    engine, replica: Replica, split: str, spec: WorkerSpec, pad_id: int, device: torch.device
) -> list[tuple[int, float, int, float, int]]:
    """Every row of a split as the engine labels it, gathered from all workers (each replica's from
    the rank that holds its logits) and ordered by row: (row, loss, label, its probability, true
    label). The padding rows are dropped by their row number (-1)."""
    engine.eval()
    local: list[tuple[int, float, int, float, int]] = []
    for batch in evaluation_batches(
        spec.evaluation[split], spec.plan.micro_batch, spec.train, pad_id, pin=device.type == "cuda"
    ):
        batch = replica.join(batch, pad_id)
        logits = replica.logits(batch, device)
        if not replica.leads:
            continue
        real, labels, logits = batch["row"] >= 0, batch["labels"], logits.float().cpu()
        losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="none")
        best = logits.softmax(-1).max(-1)
        local += zip(
            batch["row"][real].tolist(),
            losses[real].tolist(),
            best.indices[real].tolist(),
            best.values[real].tolist(),
            labels[real].tolist(),
            strict=True,
        )
    engine.train()  # training may go on mid-epoch
    gathered: list[list] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return sorted(row for part in gathered for row in part)


def validate(
    engine, replica: Replica, spec: WorkerSpec, pad_id: int, device: torch.device
) -> tuple[float, float, list[int]]:
    """Exact loss, accuracy and row-ordered predictions over the whole validation split."""
    rows = predicted(engine, replica, "validation", spec, pad_id, device)
    return (sum(r[1] for r in rows) / len(rows), sum(r[2] == r[4] for r in rows) / len(rows), [r[2] for r in rows])


def label_test_split(engine, replica: Replica, spec: WorkerSpec, pad_id: int, device: torch.device) -> Predictions:
    """The test split as the trained engine labels it, for evaluation and the test split's batch
    inference: the model is here already (1,066 rows: 3-4 s, against 8 s for a new process to load
    the exported model and label them, and 10 s more for batch inference to do it again)."""
    rows = predicted(engine, replica, "test", spec, pad_id, device)
    return Predictions(labels=[r[2] for r in rows], scores=[r[3] for r in rows], truth=[r[4] for r in rows])


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
    without_cudnn_attention()
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


def train_worker(config: dict, first_epoch: Future[Iterator[dict]] | None = None) -> None:
    """A Ray Train worker: the spec, the driver's channel (tasks/core/progress.py) and the tests' hooks
    from the config, then training, its heartbeats posted (the last one exactly, if it fails).
    `first_epoch`: the first epoch's rows, already being read (tasks/train/stream.py)."""
    spec, channel = WorkerSpec.model_validate(config["spec"]), config.get("channel")
    if config.get("check_devices"):
        devices.check_collectives(ray.train.torch.get_device())
    with Pulse(channel, ray.train.get_context().get_world_rank()).beating() as pulse:
        run(spec, channel, pulse, Fault.model_validate(config["fault"]) if config.get("fault") else None, first_epoch)


def run(
    spec: WorkerSpec,
    channel: str | None,
    pulse: Pulse,
    fault: Fault | None,
    first_epoch: Future[Iterator[dict]] | None = None,
) -> None:
    """Epochs of micro-batches until the last epoch or max_steps, evaluating and checkpointing on the
    steps the config names and at every epoch's end; then rank 0 exports the model.

    Resume: the engine state and the progress come from the last checkpoint; a checkpoint taken
    mid-epoch continues that epoch, reading its first `batches_done` micro-batches again (the same
    ones: the order follows from the seed) and skipping them without computing on them. Nothing is
    trained twice; the dropout masks after the resume differ from an uninterrupted run's.
    """
    started, cfg, marks = time.perf_counter(), spec.train, Marks(started=time.time())
    engine, device, tokenizer, replica = setup(spec, pulse)
    marks.engine_built = time.time()
    if dist.get_rank() == 0 and channel is not None:
        say(channel, logging.INFO, engine_line(engine, device, time.perf_counter() - started))
    pulse("resuming")
    progress, pad_id, meter, pin = (
        resume(engine, channel),
        tokenizer.pad_token_id or 0,
        Meter(device),
        device.type == "cuda",
    )
    first_epoch, resumed_from, predictions = progress.epoch, engine.global_steps, None
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
        stream = first_epoch.result() if first_epoch and epoch == 0 else drawn(spec.plan.micro_batch, cfg, epoch)
        for batch in islice(training_batches(stream, cfg, pad_id, epoch, pin=pin), done, None):
            marks.first_batch = marks.first_batch or time.time()
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
                first_done, marks.first_step = time.perf_counter(), marks.first_step or time.time()
            else:
                samples += rows
            if engine.global_steps == steps_before:
                continue
            step, position, pause_from = engine.global_steps, epoch + done / spec.batches_per_epoch, time.perf_counter()
            marks.last_step = time.time()
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
    pulse("labelling the test split", engine.global_steps)
    test = label_test_split(engine, replica, spec, pad_id, device) if "test" in spec.evaluation else None
    marks.test_labelled = time.time()
    pulse("exporting the model", engine.global_steps)
    export(
        replica,
        tokenizer,
        spec,
        Result(
            history=progress.history,
            curve=progress.curve,
            validation_predictions=predictions,
            test=test,
            nodes=nodes,
            layer_parameter_mb=layer_parameter_mb(replica.layers()),
            marks=marks,
        ),
    )
