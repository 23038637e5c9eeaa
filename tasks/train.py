"""Stage 2: data-parallel fine-tuning, Ray Train workers each driving a DeepSpeed engine.

The worker loop is ours (not the HF Trainer) so that the DeepSpeed engine, its ZeRO stage and its
checkpoints stay visible and configurable; transformers still does all model I/O.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import ray.train
import torch
import torch.distributed as dist
from prefect import get_run_logger, task
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

from tasks import cluster, storage
from tasks.config import TrainConfig

STATE_FILE = "training_state.json"  # epoch, metrics and the engine's validation predictions
PROGRESS_EVERY = 50  # steps between progress lines from rank 0


def deepspeed_config(cfg: TrainConfig, workers: int, total_steps: int, bf16: bool) -> dict:
    """The DeepSpeed JSON, derived from the typed config in this one place."""
    if cfg.batch_size % workers:
        raise ValueError(f"batch_size={cfg.batch_size} is not divisible by {workers} workers; pick a multiple of {workers}")
    return {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": cfg.batch_size // workers,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": cfg.zero_stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": bf16},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": cfg.learning_rate,
                "warmup_num_steps": int(total_steps * cfg.warmup_ratio),
                "total_num_steps": total_steps,
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10**9,
    }


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


def fit_epoch(engine, loader: DataLoader, epoch: int, device: torch.device) -> tuple[float, float]:
    """One pass over this worker's shard; returns (mean loss over all workers, samples/s)."""
    loader.sampler.set_epoch(epoch)
    engine.train()
    loss_sum, batches, samples, start = torch.zeros(1), 0, 0, time.perf_counter()
    for batch in loader:
        loss = engine(**_to(batch, device)).loss
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().float().cpu()
        batches += 1
        samples += len(batch["labels"])
        if batches % PROGRESS_EVERY == 0 and dist.get_rank() == 0:
            print(f"epoch {epoch + 1} step {batches}/{len(loader)} loss {loss_sum.item() / batches:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    totals = torch.tensor([loss_sum.item(), batches, samples], dtype=torch.float64)
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item(), totals[2].item() / elapsed


@torch.no_grad()
def validate(engine, loader: DataLoader, device: torch.device) -> tuple[float, float, list[int]]:
    """Exact loss, accuracy and row-ordered predictions over the whole split, gathered from all workers.

    DistributedSampler pads the last shard with repeated rows; gathering by row index drops them.
    """
    engine.eval()
    indices = iter(loader.sampler)
    local: list[tuple[int, float, int, int]] = []
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


def train_worker(config: dict) -> None:
    import deepspeed  # imported in the worker: it probes the accelerator at import

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames used by DeepSpeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg = TrainConfig(**config["train"])
    set_seed(cfg.seed)
    torch.set_num_threads(cfg.cpus_per_worker)
    device = ray.train.torch.get_device()
    use_cuda = device.type == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    world = dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.model_max_length = config["max_length"]  # the exported tokenizer truncates as training did
    model = AutoModelForSequenceClassification.from_pretrained(
        config["model"],
        num_labels=len(config["label_names"]),
        id2label=dict(enumerate(config["label_names"])),
        label2id={name: i for i, name in enumerate(config["label_names"])},
    )
    micro = cfg.batch_size // world
    train_loader = _loader(read_tokenized(config["train_uri"]), micro, tokenizer.pad_token_id, True, cfg.seed)
    val_loader = _loader(read_tokenized(config["validation_uri"]), micro, tokenizer.pad_token_id, False, cfg.seed)
    total_steps = cfg.epochs * len(train_loader)
    bf16 = use_cuda and torch.cuda.is_bf16_supported()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, world, total_steps, bf16)
    )

    for epoch in range(cfg.epochs):
        train_loss, samples_per_s = fit_epoch(engine, train_loader, epoch, device)
        val_loss, val_accuracy, predictions = validate(engine, val_loader, device)
        metrics = {
            "epoch": epoch + 1,
            "step": engine.global_steps,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_accuracy,
            "samples_per_s": samples_per_s,
        }
        with tempfile.TemporaryDirectory() as tmp:
            export(engine, tokenizer, cfg.zero_stage, Path(tmp), {**metrics, "validation_predictions": predictions})
            checkpoint = Checkpoint.from_directory(tmp) if dist.get_rank() == 0 else None
            ray.train.report(metrics, checkpoint=checkpoint)


@task
def train(
    tokenized: dict[str, str],
    model_name_or_path: str,
    max_length: int,
    label_names: list[str],
    cfg: TrainConfig,
    run_dir: str,
    ray_address: str | None = None,
) -> list[dict]:
    """Fine-tune on the tokenized splits; the consolidated model lands in <run_dir>/model."""
    logger = get_run_logger()
    cluster.connect(ray_address)
    resources = cluster.Resources.of_cluster()
    workers = resources.training_workers(cfg.num_workers, cfg.cpus_per_worker)
    deepspeed_config(cfg, workers, 1, False)  # refuse a bad batch split before starting workers
    storage_path, filesystem = storage.pyarrow_filesystem(storage.join(run_dir, "train"))
    logger.info("training on %d %s worker(s), ZeRO stage %d", workers, "GPU" if resources.gpus else "CPU", cfg.zero_stage)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "train": cfg.model_dump(),
            "model": model_name_or_path,
            "max_length": max_length,
            "label_names": label_names,
            "train_uri": tokenized["train"],
            "validation_uri": tokenized["validation"],
        },
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=bool(resources.gpus), resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        torch_config=TorchConfig(backend="nccl" if resources.gpus else "gloo"),
        run_config=RunConfig(
            name="ray", storage_path=storage_path, storage_filesystem=filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    history = result.metrics_dataframe.to_dict("records")
    for row in history:
        logger.info(
            "epoch %d step %d: train_loss %.4f val_loss %.4f val_accuracy %.4f (%.1f samples/s)",
            row["epoch"], row["step"], row["train_loss"], row["val_loss"], row["val_accuracy"], row["samples_per_s"],
        )
    with tempfile.TemporaryDirectory() as tmp:
        storage.upload_dir(result.checkpoint.to_directory(tmp), storage.join(run_dir, "model"))
    return [{k: row[k] for k in ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "samples_per_s")} for row in history]
