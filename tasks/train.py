"""Stage 2: data-parallel fine-tuning, Ray Train workers each driving a DeepSpeed engine.

The worker loop is ours (not the HF Trainer) so that the DeepSpeed engine, its ZeRO stage and its
checkpoints stay visible and configurable; transformers still does all model I/O.
"""

from __future__ import annotations

import json
import logging
import resource
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path

import pyarrow.parquet as pq
import ray.train
import torch
import torch.distributed as dist
from prefect import get_run_logger, task
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, set_seed
from transformers.integrations.deepspeed import HfDeepSpeedConfig

from tasks import cluster, storage
from tasks.config import TrainConfig

STATE_FILE = "training_state.json"  # per-epoch history, the curve and the engine's validation predictions
# Carried by every training task run: a Prefect concurrency limit on this tag (deployments/) keeps
# two training runs from competing for one Ray cluster.
TRAINING_TAG = "ray-training"
# glibc raises its mmap threshold to 32 MiB after the first large free, so tensors up to that size
# are then carved from the heap and fragment it: ZeRO-3's per-layer gathers grew a CPU worker's RSS
# by ~200 MiB in 4 steps. A fixed threshold hands every freed tensor above 64 KiB back to the OS, at
# the price of page faults on every allocation (-25% samples/s at ZeRO-2): so for ZeRO-3 only, the
# choice made to save memory.
ZERO3_WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}
ENGINE_DIR, MODEL_DIR = "deepspeed", "model"  # the two parts of a checkpoint


@dataclass(frozen=True)
class Plan:
    """How a TrainConfig lands on this cluster; checked before any training worker starts."""

    workers: int
    micro_batch: int
    accumulation: int
    use_gpu: bool
    precision: str  # fp32, fp16, bf16, or auto (bf16 where the GPU has it, else fp16)

    def describe(self, cfg: TrainConfig) -> str:
        device = "GPU" if self.use_gpu else "CPU"
        return (f"{self.workers} {device} worker(s) x micro-batch {self.micro_batch} x accumulation {self.accumulation}"
                f" = global batch {cfg.batch_size}, ZeRO-{cfg.zero_stage}, {self.precision}")


def cpu_has_native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def plan(cfg: TrainConfig, resources: cluster.Resources) -> Plan:
    """Resolve workers, micro-batch, accumulation and precision, or say what to change."""
    workers = resources.training_workers(cfg.num_workers, cfg.cpus_per_worker)
    micro = cfg.micro_batch_size or cfg.batch_size // workers
    if micro < 1 or cfg.batch_size % (workers * micro):
        raise ValueError(
            f"batch_size={cfg.batch_size} is not divisible by {workers} workers x micro_batch_size={micro}; "
            f"use a batch_size that is a multiple of {workers * max(micro, 1)} or change micro_batch_size/num_workers"
        )
    use_gpu = bool(resources.gpus)
    if not use_gpu and cfg.precision == "fp16":
        raise ValueError("precision=fp16 needs a GPU and this cluster has none: use fp32 (or auto)")
    if not use_gpu and cfg.precision == "bf16" and not cpu_has_native_bf16():
        raise ValueError("precision=bf16: this CPU has no native bf16 (avx512_bf16/amx) and this cluster no GPU: use fp32")
    if not use_gpu and cfg.activation_offload:
        raise ValueError("activation_offload moves GPU activations to CPU memory; this cluster has no GPU: set it false")
    precision = "fp32" if cfg.precision == "auto" and not use_gpu else cfg.precision
    return Plan(workers, micro, cfg.batch_size // (workers * micro), use_gpu, precision)


def merge(base: dict, override: dict) -> dict:
    """Deep merge: the expert's raw DeepSpeed keys win, nested sections are merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def deepspeed_config(cfg: TrainConfig, plan: Plan, total_steps: int, hidden_size: int = 768) -> dict:
    """The DeepSpeed JSON, derived from the typed config in this one place."""
    zero: dict = {"stage": cfg.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if cfg.zero_stage == 3:
        # ZeRO-3 buffers sized to the model, as transformers' "auto" values do; DeepSpeed's defaults
        # are for billion-parameter models. Its default live/reuse limits (1e9 parameters) would keep
        # every gathered layer of a smaller model until backward, undoing the partitioning: allow
        # about one transformer layer (~12 hidden^2 parameters) instead.
        layer = 12 * hidden_size**2
        zero |= {"reduce_bucket_size": hidden_size**2, "stage3_prefetch_bucket_size": int(0.9 * hidden_size**2),
                 "stage3_param_persistence_threshold": 10 * hidden_size,
                 "stage3_max_live_parameters": layer, "stage3_max_reuse_distance": layer}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": plan.use_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": plan.use_gpu}
    warmup_steps = max(1, int(total_steps * cfg.warmup_ratio))  # DeepSpeed's schedulers need >= 1
    adam = {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}
    if cfg.offload_optimizer:
        adam["torch_adam"] = False  # offloaded state needs DeepSpeedCPUAdam
    else:
        # torch's fused AdamW: no JIT build, and no per-step temporaries (a fresh 90 MB `sqrt` of the
        # flat ZeRO partition page-faulted on every step): MiniLM's optimizer step 0.33 -> 0.15 s at
        # ZeRO-2, 0.15 -> 0.05 s at ZeRO-0, on CPU.
        adam |= {"torch_adam": True, "fused": True}
    derived = {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": cfg.learning_rate,
                "warmup_num_steps": warmup_steps,
                "total_num_steps": max(total_steps, warmup_steps + 1),
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10**9,
    }
    return merge(derived, cfg.deepspeed)


def read_tokenized(uri: str) -> list[dict]:
    path, filesystem = storage.pyarrow_filesystem(uri)
    table = pq.read_table(path, filesystem=filesystem).sort_by("row")
    return table.select(["input_ids", "label"]).to_pylist()


def collate(pad_id: int):
    def pad(rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        labels = torch.tensor([r["label"] for r in rows])
        return {"input_ids": ids, "attention_mask": (ids != pad_id).long(), "labels": labels}

    return pad


def _loader(rows: list[dict], micro_batch: int, pad_id: int, shuffle: bool, seed: int) -> DataLoader:
    ctx = ray.train.get_context()
    sampler = DistributedSampler(
        rows, num_replicas=ctx.get_world_size(), rank=ctx.get_world_rank(), shuffle=shuffle, seed=seed
    )
    return DataLoader(rows, batch_size=micro_batch, sampler=sampler, collate_fn=collate(pad_id))


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


class Curve:
    """Loss and accuracy per optimizer step, for the run report's plots: training averaged over the
    rows of every `every` steps on all workers, validation at each evaluation. It travels in the
    checkpoint, so a resumed run's curve has every step once."""

    def __init__(self, every: int, recorded: dict, device: torch.device):
        self.every, self.train, self.validation = every, recorded["train"], recorded["validation"]
        # loss x rows, rows right, rows: summed on the device, read only every `every` steps (no sync per batch)
        self.window = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        rows = torch.tensor(len(labels), dtype=torch.float64, device=labels.device)
        self.window += torch.stack([loss.double() * rows, (logits.argmax(-1) == labels).sum().double(), rows])

    def stepped(self, step: int, epoch: float) -> None:
        if step % self.every:
            return
        dist.all_reduce(self.window)
        loss_x_rows, right, rows = self.window.tolist()
        self.window.zero_()
        self.train.append({"step": step, "epoch": round(epoch, 4), "loss": loss_x_rows / rows, "accuracy": right / rows})
        if dist.get_rank() == 0:
            print(f"step {step} (epoch {epoch:.2f}): loss {loss_x_rows / rows:.4f} accuracy {right / rows:.4f}", flush=True)

    def state(self) -> dict:
        return {"train": self.train, "validation": self.validation}


def fit_epoch(
    engine, loader: DataLoader, epoch: int, device: torch.device, offload_activations: bool, curve: Curve,
    skip: int = 0, after_step: Callable[[int], None] = lambda batches_done: None,
) -> dict:
    """One pass over this worker's shard, less the `skip` micro-batches a resumed run already did.

    The sampler's order depends only on seed and epoch, so skipping replays exactly where the
    checkpoint left off. `after_step(batches done)` runs after every optimizer step (evaluations,
    checkpoints). Returns the mean loss over all workers, the steady-state samples/s (after the first
    batch, which pays one-time costs, and without the time spent in after_step) and when the first
    batch ended (perf_counter).
    """
    loader.sampler.set_epoch(epoch)
    engine.train()
    loss_sum, batches, samples, paused = torch.zeros(1, device=device), 0, 0, 0.0  # on the device: no sync per batch
    first_done = time.perf_counter()
    for batch in islice(loader, skip, None):
        batch = _to(batch, device)
        # save_on_cpu keeps the tensors autograd saves for backward in host memory until needed.
        with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload_activations else nullcontext():
            output = engine(**batch)
            engine.backward(output.loss)
        steps_before = engine.global_steps
        engine.step()  # an optimizer step only at the end of an accumulation cycle
        loss_sum += output.loss.detach().float()
        curve.add(output.loss.detach(), output.logits.detach(), batch["labels"])
        batches += 1
        if batches == 1:
            first_done = time.perf_counter()
        else:
            samples += len(batch["labels"])
        if engine.global_steps != steps_before:
            started = time.perf_counter()
            curve.stepped(engine.global_steps, epoch + (skip + batches) / len(loader))
            after_step(skip + batches)
            paused += time.perf_counter() - started
    elapsed = time.perf_counter() - first_done - paused
    totals = torch.tensor([loss_sum.item(), batches, samples], dtype=torch.float64)
    dist.all_reduce(totals)
    return {
        "train_loss": totals[0].item() / max(totals[1].item(), 1),
        "samples_per_s": totals[2].item() / elapsed if elapsed > 0 else 0.0,
        "first_batch_done": first_done,
    }


@torch.no_grad()
def validate(engine, loader: DataLoader, device: torch.device) -> tuple[float, float, list[int]]:
    """Exact loss, accuracy and row-ordered predictions over the whole split, gathered from all workers.

    DistributedSampler pads the last shard with repeated rows; gathering by row index drops them.
    Torch's random state is put back afterwards: starting the loader draws from it, which would
    otherwise make the evaluation cadence change the dropout masks of every later training step.
    """
    engine.eval()
    indices = iter(loader.sampler)
    local: list[tuple[int, float, int, int]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for batch in loader:
            batch = _to(batch, device)
            logits = engine(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
            losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
            for loss, pred, label in zip(losses.tolist(), logits.argmax(-1).tolist(), batch["labels"].tolist()):
                local.append((next(indices), loss, pred, label))
    gathered: list[list] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    by_row = {row: (loss, pred, label) for part in gathered for row, loss, pred, label in part}
    rows = [by_row[i] for i in sorted(by_row)]
    loss = sum(r[0] for r in rows) / len(rows)
    accuracy = sum(r[1] == r[2] for r in rows) / len(rows)
    return loss, accuracy, [r[1] for r in rows]


def export(engine, tokenizer, stage: int, directory: Path, state: dict) -> None:
    """A consolidated HF model folder; under ZeRO-3 every rank must join the gather."""
    weights = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()
    if dist.get_rank() == 0:
        engine.module.save_pretrained(directory, state_dict=weights)
        tokenizer.save_pretrained(directory)
        (directory / STATE_FILE).write_text(json.dumps(state))


def peak_memory_mb(device: torch.device) -> float:
    """The largest peak over workers: accelerator memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB
    worst = torch.tensor([peak], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def save(engine, position: dict, metrics: dict, export_model: tuple | None = None) -> None:
    """Report a checkpoint from every rank: the DeepSpeed engine state (each rank writes its own
    ZeRO shards, Ray gathers them into one checkpoint) and, at epoch ends, the exported model.
    `position` (epoch, micro-batches done, per-epoch history, the curve) travels inside the engine state."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(f"{tmp}/{ENGINE_DIR}", tag="state", client_state={"position": position})
        if export_model:
            tokenizer, stage, final = export_model
            export(engine, tokenizer, stage, Path(tmp) / MODEL_DIR, final)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def resume(engine) -> dict:
    """Load the latest checkpoint Ray Train holds for this run (after a worker failure, a task
    retry or a re-run with the same run id); return its position, or the start of training."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return {"epoch": 0, "batches_done": 0, "history": [], "curve": {"train": [], "validation": []}}
    with checkpoint.as_directory() as folder:
        _, client_state = engine.load_checkpoint(f"{folder}/{ENGINE_DIR}", tag="state")
    position = client_state["position"]
    if dist.get_rank() == 0:
        print(f"resumed at step {engine.global_steps}: epoch {position['epoch'] + 1}, batch {position['batches_done']}", flush=True)
    return position


def build_model(config: dict, cfg: TrainConfig, ds_config: dict):
    # While this object lives, from_pretrained builds a ZeRO-3 model already partitioned (zero.Init):
    # no worker ever holds the whole model, which is what lets ZeRO-3 fit models that do not fit.
    zero_init = HfDeepSpeedConfig(ds_config) if cfg.zero_stage == 3 else None  # noqa: F841 (kept alive)
    model = AutoModelForSequenceClassification.from_pretrained(
        config["model"],
        num_labels=len(config["label_names"]),
        id2label=dict(enumerate(config["label_names"])),
        label2id={name: i for i, name in enumerate(config["label_names"])},
    )
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def param_groups(model) -> list[dict]:
    """Weight decay for weight matrices only, as BERT-style recipes do."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.ndim > 1]}, {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0}]


def setup(config: dict) -> tuple:
    """This worker's part: the process group, the data loaders and the DeepSpeed engine."""
    import deepspeed  # imported in the worker: it probes the accelerator at import

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames used by DeepSpeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg, plan = TrainConfig(**config["train"]), Plan(**config["plan"])
    set_seed(cfg.seed)
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    device = ray.train.torch.get_device()
    if plan.precision == "auto":  # on GPU: bf16 where the hardware has it
        plan = replace(plan, precision="bf16" if torch.cuda.is_bf16_supported() else "fp16")
    if plan.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision=bf16 but {torch.cuda.get_device_name()} has no bf16: use fp16 or auto")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")

    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.model_max_length = config["max_length"]  # the exported tokenizer truncates as training did
    train_loader = _loader(read_tokenized(config["train_uri"]), plan.micro_batch, tokenizer.pad_token_id, True, cfg.seed)
    val_loader = _loader(read_tokenized(config["validation_uri"]), plan.micro_batch, tokenizer.pad_token_id, False, cfg.seed)
    total_steps = cfg.epochs * (len(train_loader) // plan.accumulation)
    hidden_size = getattr(AutoConfig.from_pretrained(config["model"]), "hidden_size", 768)
    ds_config = deepspeed_config(cfg, plan, total_steps, hidden_size)
    model = build_model(config, cfg, ds_config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config)
    return cfg, device, tokenizer, train_loader, val_loader, engine


def train_worker(config: dict) -> None:
    started = time.perf_counter()
    cfg, device, tokenizer, train_loader, val_loader, engine = setup(config)
    position = resume(engine)
    start_epoch, history, resumed_from = position["epoch"], position["history"], engine.global_steps
    curve = Curve(cfg.log_every_steps, position["curve"], device)

    def evaluated(epoch: float) -> list[int]:
        loss, accuracy, predictions = validate(engine, val_loader, device)
        engine.train()  # validate left the model in eval mode, and training may go on mid-epoch
        curve.validation.append({"step": engine.global_steps, "epoch": round(epoch, 4), "loss": loss, "accuracy": accuracy})
        return predictions

    for epoch in range(start_epoch, cfg.epochs):
        checkpoint_seconds = []

        def after_step(batches_done: int, epoch: int = epoch) -> None:
            step, progress = engine.global_steps, epoch + batches_done / len(train_loader)
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and batches_done < len(train_loader):
                evaluated(progress)  # the epoch's end is evaluated below
            if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
                saving_from = time.perf_counter()
                midway = {"epoch": epoch, "batches_done": batches_done, "history": history, "curve": curve.state()}
                save(engine, midway, {"epoch": progress, "step": step})
                checkpoint_seconds.append(time.perf_counter() - saving_from)

        fitted = fit_epoch(engine, train_loader, epoch, device, cfg.activation_offload, curve,
                           position["batches_done"] if epoch == start_epoch else 0, after_step)
        predictions = evaluated(epoch + 1)
        history.append({
            "epoch": epoch + 1,
            "step": engine.global_steps,
            "resumed_from_step": resumed_from,
            "train_loss": fitted["train_loss"],
            "val_loss": curve.validation[-1]["loss"],
            "val_accuracy": curve.validation[-1]["accuracy"],
            "samples_per_s": fitted["samples_per_s"],
            "peak_memory_mb": peak_memory_mb(device),
            # this attempt's start-up (model load, engine build, first batch), in its first epoch only
            "startup_s": fitted["first_batch_done"] - started if epoch == start_epoch else None,
            "checkpoint_s": sum(checkpoint_seconds) / len(checkpoint_seconds) if checkpoint_seconds else None,
        })
        final = {"history": history, "curve": curve.state(), "validation_predictions": predictions}
        save(engine, {"epoch": epoch + 1, "batches_done": 0, "history": history, "curve": curve.state()}, history[-1],
             export_model=(tokenizer, cfg.zero_stage, final))


@task(tags=[TRAINING_TAG])
def train(
    tokenized: dict[str, str],
    model_name_or_path: str,
    max_length: int,
    label_names: list[str],
    cfg: TrainConfig,
    run_dir: str,
    ray_address: str | None = None,
) -> dict:
    """Fine-tune on the tokenized splits; the consolidated model lands in <run_dir>/model.
    Returns the per-epoch history ("epochs") and the loss and accuracy per step ("curve")."""
    logger = get_run_logger()
    cluster.connect(ray_address)
    resources = cluster.Resources.of_cluster()
    the_plan = plan(cfg, resources)  # refuse what cannot run before any worker starts
    storage_path, filesystem = storage.pyarrow_filesystem(storage.join(run_dir, "train"))
    logger.info("training on %s", the_plan.describe(cfg))
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "train": cfg.model_dump(),
            "plan": asdict(the_plan),
            "model": model_name_or_path,
            "max_length": max_length,
            "label_names": label_names,
            "train_uri": tokenized["train"],
            "validation_uri": tokenized["validation"],
        },
        scaling_config=ScalingConfig(
            num_workers=the_plan.workers, use_gpu=the_plan.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        torch_config=TorchConfig(backend="nccl" if the_plan.use_gpu else "gloo"),
        run_config=RunConfig(
            name="ray", storage_path=storage_path, storage_filesystem=filesystem,
            worker_runtime_env={"env_vars": ZERO3_WORKER_ENV if cfg.zero_stage == 3 else {}},
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )
    result = trainer.fit()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(result.checkpoint.to_directory(tmp)) / MODEL_DIR
        state = json.loads((model_dir / STATE_FILE).read_text())
        storage.upload_dir(model_dir, storage.join(run_dir, "model"))
    for row in state["history"]:
        logger.info(
            "epoch %d step %d: train_loss %.4f val_loss %.4f val_accuracy %.4f (%.1f samples/s, peak %.0f MiB per worker)%s",
            row["epoch"], row["step"], row["train_loss"], row["val_loss"], row["val_accuracy"], row["samples_per_s"],
            row["peak_memory_mb"],
            f", resumed from step {row['resumed_from_step']}" if row["resumed_from_step"] else "",
        )
    return {"epochs": state["history"], "curve": state["curve"]}
