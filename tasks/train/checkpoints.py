"""A training worker's checkpoints: saved through Ray Train (every rank its DeepSpeed shards, the
progress inside), resumed from the latest, the exported model (rank 0, straight into storage), and the
CheckpointPolicy the loop (tasks/train/worker.py) asks when to validate, checkpoint and stop, and which
step to export."""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint

from tasks.contracts.training import SCORE, STATE_FILE, UNVALIDATED, Curve, Kept, Result
from tasks.core import storage
from tasks.core.progress import say
from tasks.core.train_config import TrainConfig
from tasks.train.engine import loaded, precision_of
from tasks.train.lora import merged
from tasks.train.passes import TRAINED_FILE, saved_keys
from tasks.train.replica import Replica
from tasks.train.reshard import TAG, load_resharded, needs_resharding
from tasks.train.resumable import PROGRESS_FILE
from tasks.train.spec import Progress, WorkerSpec


def save(engine, progress: Progress, metrics: dict, trained: np.ndarray | None = None) -> None:
    """Report a checkpoint from every rank: each writes its own ZeRO shards of the DeepSpeed engine
    state and Ray gathers them into one checkpoint; rank 0 adds the progress, and mid-epoch the keys of
    the rows the epoch has trained (`trained`, tasks/train/passes.py)."""
    progress = progress.model_copy(update={"step": engine.global_steps, "world_size": dist.get_world_size()})
    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder, tag=TAG, exclude_frozen_parameters=partly_frozen(engine))
        if dist.get_rank() == 0:
            Path(folder, PROGRESS_FILE).write_text(progress.model_dump_json())
            if trained is not None:
                np.save(Path(folder, TRAINED_FILE), trained)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def partly_frozen(engine) -> bool:
    """Whether the engine trains part of its model (LoRA). Its checkpoints then hold that part alone: the
    frozen weights are the model's own, loaded (or drawn at the same seed) again on a resume. A LoRA
    checkpoint of a 1B-parameter model is ~20 MB where the whole would be 4 GiB, written twice (the
    worker's folder, then Ray's copy in storage)."""
    return any(not parameter.requires_grad for parameter in engine.module.parameters())


def restore(engine, folder: str) -> dict:
    """The engine's state from a checkpoint's folder (save), written at this world size or another
    (tasks/train/reshard.py); its client state."""
    strict = not partly_frozen(engine)
    if needs_resharding(engine, folder):
        return load_resharded(engine, folder, strict)
    return engine.load_checkpoint(folder, tag=TAG, load_module_strict=strict)[1]


def resume(engine, channel: str | None) -> tuple[Progress, np.ndarray]:
    """Load the latest checkpoint Ray Train holds for this run (after a worker failure, a task
    retry or a re-run with the same run id) and return its progress, or the start of training, and
    the keys of the rows its epoch had trained. One that cannot go on at this world size was refused by
    the driver (tasks/train/resumable.py)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Progress(), np.zeros(0, dtype=np.int64)
    with checkpoint.as_directory() as folder:
        saved = Path(folder, PROGRESS_FILE)
        progress = Progress.model_validate_json(saved.read_text()) if saved.exists() else None
        client_state, trained = restore(engine, folder), saved_keys(folder)
    # Checkpoints saved before ftflow wrote PROGRESS_FILE kept it in DeepSpeed's client state.
    progress = progress or Progress.model_validate(client_state["progress"])
    if dist.get_rank() == 0 and channel is not None:
        say(
            channel,
            logging.INFO,
            f"rank 0: resumed from the checkpoint at step {engine.global_steps}: epoch {progress.epoch + 1}, "
            f"{progress.rows_done} of its rows trained",
        )
    return progress, trained


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# From here an fp32 export is more than a CPU serves well, and its host memory on rank 0 counts: 4 bytes
# a parameter, beside the 16-bit gathered weights (bench/RESULTS.md: an 8.2B model's export took 104 s).
LARGE_MODEL_PARAMS = 10**9


def export_dtype(setting: str, trained_in: str, params: int) -> torch.dtype:
    """train.export_precision resolved: auto is fp32 for models under LARGE_MODEL_PARAMS or trained in fp32
    (a 16-bit model loads as one by default, 2.4x slower on a CPU in bf16; evaluation and inference choose
    their own precision at load), else the precision it trained in."""
    if setting == "auto":
        setting = "fp32" if params < LARGE_MODEL_PARAMS else trained_in
    return DTYPES[setting]


def export(replica: Replica, tokenizer, spec: WorkerSpec, result: Result) -> None:
    """Rank 0 writes the consolidated HF model folder straight into the run's storage (the driver
    never downloads checkpoint shards), in train.export_precision; where the parameters are split every
    rank joins the gather."""
    model, weights = replica.exported()
    if dist.get_rank() == 0:
        weights = weights or model.state_dict()
        trained_in = precision_of(replica.engine)
        dtype = export_dtype(
            spec.train.export_precision, trained_in, sum(tensor.numel() for tensor in weights.values())
        )
        if spec.train.lora:  # one folder with the adapters merged into the frozen weights
            rounded = spec.init == "pretrained" and DTYPES[trained_in].itemsize < dtype.itemsize
            checkpoint = loaded(spec, tokenizer.pad_token_id)[0] if rounded else None
            model, weights = merged(model, weights, spec.adapter_uri, checkpoint)
        weights = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in weights.items()}
        config = copy.deepcopy(model.config)
        config.dtype = dtype  # transformers takes the saved dtype from the module's parameters
        # What it is (a token classifier, a sequence classifier), as model.save_pretrained writes it: the copy
        # keeps the architecture of the checkpoint it was loaded from, a base model's or another head's.
        config.architectures = [type(model).__name__]
        if result.thresholds is not None:  # what inference decides each label by (tasks/core/predictor.py)
            config.label_thresholds = result.thresholds
        if spec.targets.pairs:  # inference reads pairs of texts, truncated as training's were
            config.text_pair_truncation = spec.targets.pairs
        if spec.targets.stride is not None:  # inference reads long texts in windows, as training did
            config.window_stride = spec.targets.stride
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder, state_dict=weights)
            config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            Path(folder, STATE_FILE).write_text(result.model_dump_json())
            storage.move_dir(folder, spec.model_uri)
    dist.barrier()


def due(every: int, step: int, last: bool) -> bool:
    """Whether a schedule of every `every` steps (0: none) falls on this step, short of the epoch's last
    (the epoch's end validates and checkpoints on its own)."""
    return bool(every and step % every == 0 and not last)


@dataclass(frozen=True)
class CheckpointPolicy:
    """What the loop decides on its validations and checkpoints, from the config and the validation
    curve (which every checkpoint holds, so a resumed run decides as an uninterrupted one): when a step
    is validated and checkpointed, early stopping, and which step is exported (keep_best)."""

    cfg: TrainConfig

    def validates(self, step: int, last: bool) -> bool:
        """Whether this optimizer step is validated (the epoch's last is, at the epoch's end)."""
        return due(self.cfg.eval_every_steps, step, last)

    def checkpoints(self, step: int, last: bool, validated: bool, curve: Curve) -> bool:
        """Whether this step is checkpointed mid-epoch: on the config's schedule, and with keep_best at
        every validation that scored better than every one before it."""
        scheduled = due(self.cfg.checkpoint_every_steps, step, last)
        return scheduled or (validated and self.cfg.keep_best and curve.evaluations_since_best(self.cfg.monitor) == 0)

    def patience_spent(self, curve: Curve) -> bool:
        """Early stopping's test, after an evaluation: early_stopping_patience evaluations in a row
        without a better monitor value."""
        patience = self.cfg.early_stopping_patience
        return patience is not None and curve.evaluations_since_best(self.cfg.monitor) >= patience

    def stop_reason(self, curve: Curve, step: int) -> str:
        monitor = self.cfg.monitor
        if self.patience_spent(curve):
            best = curve.validation[-1 - curve.evaluations_since_best(monitor)]
            return (
                f"early stopping at step {step}: no better {monitor} in {self.cfg.early_stopping_patience} "
                f"evaluation(s) than step {best.step}'s {best.value(monitor):.4f}"
            )
        if self.cfg.max_steps and step >= self.cfg.max_steps:
            return f"max_steps={self.cfg.max_steps}"
        return f"epochs={self.cfg.epochs}"

    def reported(self, curve: Curve, step: int, position: float, validated: bool) -> dict:
        """What a report to Ray Train says: where training is, and the validation there if it just ran."""
        # evaluations: the clock of Ray Tune's ASHA, whose grace period counts them (tasks/sweep/)
        metrics = {"epoch": position, "step": step, "evaluations": len(curve.validation), SCORE: UNVALIDATED}
        if validated:
            point = curve.validation[-1]
            metrics |= {"val_loss": point.loss, SCORE: point.score(self.cfg.monitor)}
            metrics |= {"val_accuracy": point.accuracy} if point.accuracy is not None else {}
            metrics |= {"val_entity_f1": point.entity_f1} if point.entity_f1 is not None else {}
        return metrics

    def kept(self, curve: Curve, step: int) -> tuple[Kept, Checkpoint | None]:
        """The step to export, and its checkpoint where the engine must load it: with keep_best, the
        one Ray Train ranks best (of equal monitor values the later); else the last step."""
        monitor, validation = self.cfg.monitor, curve.validation
        last = Kept(validation=validation[-1], reason="the last step (keep_best=false)")
        if not self.cfg.keep_best:
            return last, None
        best = max(
            ray.train.get_all_reported_checkpoints(),
            key=lambda r: (r.metrics.get(SCORE, UNVALIDATED), r.metrics["step"]),
        )
        if best.metrics["step"] == step:
            return last.model_copy(update={"reason": "the last step, also the best validated (keep_best)"}), None
        point = next(point for point in validation if point.step == best.metrics["step"])
        reason = (
            f"the best validated (keep_best): {monitor} {point.value(monitor):.4f}, against "
            f"{last.validation.value(monitor):.4f} at the last step, {last.step}"
        )
        return Kept(validation=point, reason=reason), best.checkpoint
