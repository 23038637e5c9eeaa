"""Stage 2, the worker side: what every Ray Train worker runs, `train_worker`, a DeepSpeed engine
fed by its shard of the streamed tokenized splits (tasks/train/batches.py), trained and validated
through its Replica (tasks/train/replica.py), saved, resumed and exported by tasks/train/checkpoints.py. The driver
(tasks/train/driver.py) hands it a WorkerSpec and reads back a Result (tasks/contracts/training.py).
This module imports no Prefect and no driver code, so workers start without them.

The loop is ours (not the HF Trainer) so that the DeepSpeed engine, its ZeRO stage and its
checkpoints stay visible and configurable; transformers still does all model I/O.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from tasks.contracts.training import (
    EpochRecord,
    Kept,
    Marks,
    Point,
    Predictions,
    Result,
)
from tasks.core.objective import right
from tasks.core.progress import Tick, post, say
from tasks.core.scoring import tuned_thresholds
from tasks.train.batches import training_batches
from tasks.train.checkpoints import CheckpointPolicy, export, restore, resume, save
from tasks.train.engine import engine_line, setup
from tasks.train.evaluation import predicted
from tasks.train.lora import parameter_counts
from tasks.train.passes import EpochPass, TrainedRows, rest_of_epoch
from tasks.train.preemption import Notice, described
from tasks.train.replica import on
from tasks.train.spec import Progress, WorkerSpec, at_world_size
from tasks.train.stream import drawn
from tasks.train.watch import TRAINING, Pulse


class Diverged(FloatingPointError):
    """A training loss no longer finite: the run's settings at fault, not a worker. Raised in a worker it
    would be a worker failure, which Ray Train retries from the last checkpoint (it offers no failure it
    does not retry), and the same seeded rows would diverge again, max_failures times."""


class Meter:
    """Training loss x rows, rows right and rows (tokens, for token_classification), summed on the device
    and read only every `log_every_steps` steps: no sync per batch. Also the rows per second between two
    reads. A loss no longer finite stops training at its read."""

    def __init__(self, device: torch.device, task: str):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.read_at, self.rows_per_s, self.task = time.perf_counter(), 0.0, task

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> None:
        real = on(labels.device, rows >= 0)
        # Not `[real]`: a boolean index sizes its result on the host, a device sync per micro-batch.
        count, scored = real.sum().double(), right(logits.detach(), labels, real, self.task).double()
        self.sums += torch.cat([(loss.detach().double() * count)[None], scored, count[None]])

    def point(self, step: int, epoch: float) -> Point:
        dist.all_reduce(self.sums)
        loss_x_rows, hits, counted, rows = self.sums.tolist()
        self.sums.zero_()
        if not math.isfinite(loss_x_rows):  # every rank reads the same sums, so every rank stops here
            raise Diverged(
                f"training diverged: the training loss is {loss_x_rows} by step {step} (lower train.learning_rate)"
            )
        now = time.perf_counter()
        self.read_at, self.rows_per_s = now, rows / (now - self.read_at)
        accuracy = hits / max(counted, 1) if self.task != "regression" else None
        return Point(step=step, epoch=round(epoch, 4), loss=loss_x_rows / max(rows, 1), accuracy=accuracy)


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


def tick(point: Point, max_steps: int, samples_per_s: float) -> Tick:
    scores = {"loss": point.loss} | ({"accuracy": point.accuracy} if point.accuracy is not None else {})
    return Tick(
        stage="train",
        done=point.step,
        total=max_steps,
        unit="steps",
        metrics=scores | {"samples_per_s": samples_per_s},
        text=f"epoch {point.epoch:.2f}, "
        + ", ".join(f"{name} {value:.4f}" for name, value in scores.items())
        + f", {samples_per_s:.1f} samples/s",
    )


def train_worker(spec: WorkerSpec, first_epoch: Future[Iterator[dict]] | None = None) -> str | None:
    """A Ray Train worker: training, its heartbeats posted on the driver's channel (the last one
    exactly, if it fails). `first_epoch`: the first epoch's rows, already being read
    (tasks/train/stream.py). Returns why training diverged, or None: rank 0's reaches the driver
    (Ray Train's Result.return_value), which raises it (tasks/train/driver.py `fitted`)."""
    context = ray.train.get_context()
    spec = at_world_size(spec, context.get_world_size())  # a range of num_workers: this group's size
    with Pulse(spec.channel, context.get_world_rank()).beating() as pulse:
        try:
            Recipe(spec, spec.channel, pulse).train(first_epoch)
        except Diverged as diverged:
            return str(diverged)
    return None


@dataclass
class EpochStats:
    """One epoch's pass (tasks/train/passes.py): micro-batches done and the split's rows trained here,
    rows after the first micro-batch, and time: from the first micro-batch's end, less evaluations and
    checkpoints, for a steady samples/s."""

    done: int
    loss_sum: torch.Tensor  # of the micro-batches trained, on the device: no sync per batch
    trained: int = 0
    rows: int = 0  # the split's rows trained here (padding not counted)
    samples: int = 0
    paused: float = 0.0
    first_done: float = field(default_factory=time.perf_counter)
    checkpoint_seconds: list[float] = field(default_factory=list)


class Recipe:
    """Epochs of micro-batches until the last epoch or max_steps, evaluating and checkpointing on the
    steps the config names and at every epoch's end; then the test split labelled and rank 0 exports
    the model.

    Resume: the engine state and the progress come from the last checkpoint; a checkpoint taken
    mid-epoch continues that epoch with the rows it had not trained, at any number of workers
    (tasks/train/passes.py). Nothing is trained twice; the dropout masks after the resume differ from an
    uninterrupted run's.
    """

    def __init__(self, spec: WorkerSpec, channel: str | None, pulse: Pulse):
        self.started, self.marks = time.perf_counter(), Marks(started=time.time())
        self.engine, self.device, self.tokenizer, self.replica = setup(spec, pulse)
        self.marks.engine_built = time.time()
        self.spec, self.cfg, self.channel, self.pulse = spec, spec.train, channel, pulse
        self.leader = dist.get_rank() == 0 and channel is not None  # says what the run's log shows
        if self.leader:
            say(channel, logging.INFO, engine_line(self.engine, self.device, time.perf_counter() - self.started))
            if (kept := spec.plan.global_batch) != spec.train.batch_size:
                say(
                    channel,
                    logging.WARNING,
                    f"on {spec.plan.workers} workers the global batch is {kept}, not batch_size={spec.train.batch_size}: "
                    f"micro-batch {spec.plan.micro_batch} x accumulation {spec.plan.accumulation}, the nearest",
                )
        pulse("resuming")
        (progress, self.resumed_keys), self.policy = resume(self.engine, channel), CheckpointPolicy(spec.train)
        self.progress = progress.trained_by(dist.get_world_size())
        self.start_epoch, self.resumed_from = self.progress.epoch, self.engine.global_steps
        self.pad_id, self.meter, self.pin = (
            self.tokenizer.pad_token_id,
            Meter(self.device, spec.targets.task),
            self.device.type == "cuda",
        )
        self.predictions: Predictions | None = None  # the last validation's, by row
        self.notice = Notice(spec.preemptible)
        self.nodes: list[str] = [None] * dist.get_world_size()
        dist.all_gather_object(self.nodes, ray.get_runtime_context().get_node_id())
        # A lone worker has no gradient to all-reduce, yet ZeRO-0's backward flattens every gradient into
        # buckets and all-reduces them over a group of one: 5-8% of a MiniLM step here. DeepSpeed's
        # no_sync skips that (ZeRO 1-3 reduce into their partitions and need it).
        alone = dist.get_world_size() == 1 and self.cfg.zero_stage == 0
        self.no_sync = self.engine.no_sync if alone else nullcontext

    def train(self, first_epoch: Future[Iterator[dict]] | None) -> None:
        for epoch in range(self.progress.epoch, self.cfg.epochs):
            if self.engine.global_steps >= self.spec.max_steps or self.policy.patience_spent(self.progress.curve):
                break
            stats = self.train_epoch(epoch, self.epoch_rows(epoch, first_epoch))
            self.end_epoch(epoch, stats)
        self.finish()

    def epoch_rows(self, epoch: int, first_epoch: Future[Iterator[dict]] | None) -> Iterator[dict]:
        """The epoch's rows for this worker: after a mid-epoch checkpoint the rest of them, else its part of
        the whole epoch from Ray Train's split (`first_epoch`'s, already being read, for the first)."""
        spec, micro = self.spec, self.spec.plan.micro_batch
        if self.progress.rows_done and epoch == self.progress.epoch:
            self.epoch_pass = EpochPass.rest(self.progress.rows_done, spec.train_rows, dist.get_world_size(), micro)
            self.trained = TrainedRows(self.resumed_keys)
            return rest_of_epoch(spec.train_uri, self.resumed_keys, self.epoch_pass, micro, self.cfg.seed, epoch)
        self.epoch_pass = EpochPass(0, spec.train_rows, spec.batches_per_epoch)
        self.trained = TrainedRows(self.resumed_keys[:0])
        fresh = first_epoch is not None and epoch == 0  # its rows already being read
        return first_epoch.result() if fresh else drawn(micro, self.cfg, epoch)

    def train_epoch(self, epoch: int, rows: Iterator[dict]) -> EpochStats:
        """One epoch's pass of micro-batches, with the triggers of each step."""
        self.engine.train()
        stats = EpochStats(done=0, loss_sum=torch.zeros((), device=self.device))
        self.pulse("waiting for the first batch", self.engine.global_steps)
        for batch in training_batches(rows, self.cfg, self.pad_id, epoch, pin=self.pin):
            self.marks.first_batch = self.marks.first_batch or time.time()
            real = int((batch["row"] >= 0).sum())  # this worker's rows, before its replica joins them
            self.trained.add(batch)
            steps_before = self.engine.global_steps
            for loss, logits, labels, rows in self.replica.train(
                self.replica.join(batch, self.pad_id), self.device, self.cfg.activation_offload, self.no_sync
            ):
                if self.replica.leads:
                    self.meter.add(loss, logits, labels, rows)
                stats.loss_sum += loss.detach().float()
            stats.done, stats.trained, stats.rows = stats.done + 1, stats.trained + 1, stats.rows + real
            if stats.trained == 1:
                stats.first_done, self.marks.first_step = time.perf_counter(), self.marks.first_step or time.time()
            else:
                stats.samples += real
            if self.engine.global_steps > steps_before and self.after_step(epoch, stats):
                break
        return stats

    def after_step(self, epoch: int, stats: EpochStats) -> bool:
        """An optimizer step's triggers: log, validate, checkpoint (the epoch's end does its own);
        True once training should stop (max_steps, or early stopping)."""
        step, pause_from, policy = self.engine.global_steps, time.perf_counter(), self.policy
        position, curve = epoch + self.epoch_pass.position(stats.done), self.progress.curve
        self.marks.last_step = time.time()
        self.pulse(TRAINING, step)
        if step % self.cfg.log_every_steps == 0:
            curve.train.append(self.meter.point(step, position))
            if self.leader:
                post(self.channel, tick(curve.train[-1], self.spec.max_steps, self.meter.rows_per_s))
        last = stats.done == self.epoch_pass.batches or step >= self.spec.max_steps
        validated = policy.validates(step, last)
        if validated:
            self.validate(position)
        preempted = self.notice.arrived()  # its checkpoint now, or the epoch's end's (last)
        if policy.checkpoints(step, last, validated, curve) or (preempted and not last):
            self.checkpoint(epoch, stats, policy.reported(curve, step, position, validated))
        elif validated:  # for Ray Tune's schedulers, which act on every evaluation (tasks/sweep/)
            ray.train.report(policy.reported(curve, step, position, validated))
        if preempted and self.leader:
            answer = (
                "the epoch's checkpoint follows" if last else f"checkpointed in {stats.checkpoint_seconds[-1]:.1f} s"
            )
            say(self.channel, logging.WARNING, f"{described()} at step {step}: {answer}; training goes on meanwhile")
        stats.paused += time.perf_counter() - pause_from
        return step >= self.spec.max_steps or policy.patience_spent(curve)

    def checkpoint(self, epoch: int, stats: EpochStats, metrics: dict) -> None:
        """A mid-epoch checkpoint, its seconds kept."""
        self.pulse("checkpointing", self.engine.global_steps)
        saving_from = time.perf_counter()
        mid_epoch = self.progress.model_copy(update={"epoch": epoch, "rows_done": self.rows_done(stats)}, deep=True)
        self.save(mid_epoch, metrics, self.trained.gathered())
        stats.checkpoint_seconds.append(time.perf_counter() - saving_from)

    def rows_done(self, stats: EpochStats) -> int:
        """The split's rows trained in this epoch so far, on every worker: before the resume, and since."""
        rows = torch.tensor([stats.rows], dtype=torch.float64, device=self.device)
        dist.all_reduce(rows)
        return self.progress.rows_done + int(rows.item())

    def validate(self, position: float) -> None:
        self.pulse("validating", self.engine.global_steps)
        loss, self.predictions = predicted(self.engine, self.replica, "validation", self.spec, self.pad_id, self.device)
        accuracy, tagged = self.predictions.accuracy, self.spec.targets.task == "token_classification"
        entity_f1 = self.predictions.entity_scores(self.spec.targets.names).f1 if tagged else None
        self.progress.curve.validation.append(
            Point(
                step=self.engine.global_steps,
                epoch=round(position, 4),
                loss=loss,
                accuracy=accuracy,
                entity_f1=entity_f1,
            )
        )

    def end_epoch(self, epoch: int, stats: EpochStats) -> None:
        """Validate, record the epoch, and checkpoint where it ended (mid-epoch when max_steps did)."""
        whole, validation = stats.done == self.epoch_pass.batches, self.progress.curve.validation
        if not validation or validation[-1].step != self.engine.global_steps:  # early stopping has just validated
            self.validate(epoch + self.epoch_pass.position(stats.done))
        self.progress.history.append(self.epoch_record(epoch, stats))
        record = self.progress.history[-1]
        self.progress = self.progress.model_copy(
            update={"epoch": epoch + 1 if whole else epoch, "rows_done": 0 if whole else record.rows}
        )
        self.pulse("checkpointing", self.engine.global_steps)
        reported = self.policy.reported(self.progress.curve, self.engine.global_steps, record.epoch, validated=True)
        self.save(self.progress, reported | record.model_dump(), None if whole else self.trained.gathered())

    def save(self, progress: Progress, metrics: dict, trained: np.ndarray | None) -> None:
        """A checkpoint reported; after a preemption notice, held by Ray Train's controller on return."""
        save(self.engine, progress, metrics, trained)
        self.notice.handed_over()

    def epoch_record(self, epoch: int, stats: EpochStats) -> EpochRecord:
        elapsed = time.perf_counter() - stats.first_done - stats.paused
        totals = torch.tensor(
            [stats.loss_sum.item(), stats.trained, stats.samples, stats.rows], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(totals)
        validation = self.progress.curve.validation[-1]
        return EpochRecord(
            epoch=round(epoch + self.epoch_pass.position(stats.done), 4),
            step=self.engine.global_steps,
            resumed_from_step=self.resumed_from,
            workers=dist.get_world_size(),
            rows=self.progress.rows_done + int(totals[3].item()),
            train_loss=totals[0].item() / max(totals[1].item(), 1),
            val_loss=validation.loss,
            val_accuracy=validation.accuracy,
            val_entity_f1=validation.entity_f1,
            samples_per_s=totals[2].item() / elapsed if elapsed > 0 else 0.0,
            peak_memory_mb=peak_memory_mb(self.device),
            startup_s=stats.first_done - self.started if epoch == self.start_epoch else None,
            checkpoint_s=sum(stats.checkpoint_seconds) / len(stats.checkpoint_seconds)
            if stats.checkpoint_seconds
            else None,
        )

    def keep(self) -> Kept:
        """The step to export (CheckpointPolicy.kept), loaded into the engine where it is not the last."""
        kept, best = self.policy.kept(self.progress.curve, self.engine.global_steps)
        if best is not None:
            self.pulse("loading the best checkpoint", kept.step)
            with best.as_directory() as folder:
                restore(self.engine, folder)
            self.predictions = None  # the last step's: the best step's are taken again (finish)
        return kept

    def finish(self) -> None:
        """The kept step's model (keep) labels the test split, then is exported with the Result."""
        engine, spec = self.engine, self.spec
        stopped = self.policy.stop_reason(self.progress.curve, engine.global_steps)
        kept = self.keep()
        if self.predictions is None:  # a re-run of a finished run trains nothing; its export still needs them
            self.predictions = predicted(engine, self.replica, "validation", spec, self.pad_id, self.device)[1]
        self.pulse("labelling the test split", engine.global_steps)
        # The test split predicted here, for evaluation and the test split's batch inference: the model
        # is here already (1,066 rows: 3-4 s, against 8 s for a new process to load the exported model
        # and label them, and 10 s more for batch inference to do it again).
        test = (
            predicted(engine, self.replica, "test", spec, self.pad_id, self.device)[1]
            if "test" in spec.evaluation
            else None
        )
        self.marks.test_labelled = time.time()
        self.pulse("exporting the model", engine.global_steps)
        parameters, trained = parameter_counts(engine.module)
        result = Result(
            history=self.progress.history,
            curve=self.progress.curve,
            validation=self.predictions,
            test=test,
            nodes=self.nodes,
            groups=self.progress.groups,
            layer_parameter_mb=layer_parameter_mb(self.replica.layers()),
            parameters=parameters,
            trained_parameters=trained,
            marks=self.marks,
            stopped=stopped,
            kept=kept,
            spec_digest=spec.digest,
            thresholds=tuned_thresholds(self.predictions.outputs, self.predictions.targets)
            if spec.targets.task == "multi_label"
            else None,
        )
        export(self.replica, self.tokenizer, spec, result)
