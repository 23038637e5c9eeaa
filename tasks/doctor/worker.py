"""`ftflow doctor`'s work on the cluster's workers (tasks/doctor/checks.py drives it): one DeepSpeed step of a
tiny BERT on the cluster's device, the engine set up as ftflow's training worker sets up its own, then
an all-reduce across the workers; and what a worker's node offers (bf16, DeepSpeed's CPU Adam op).
This module imports no Prefect, so workers start without it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import ray.train.torch
import torch
import torch.distributed as dist
from pydantic import BaseModel
from ray.util.queue import Queue
from transformers import BertConfig, BertForSequenceClassification

from tasks.train import WorkerSpec, join_process_group, param_groups, precision_of, resolve_precision

# Built in the worker from its config alone: no download, no file, a step in milliseconds.
TINY_BERT = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
SEQUENCE_LENGTH = 16


class StepReport(BaseModel):
    """What one worker saw of the step and of the all-reduce."""

    rank: int
    device: str
    backend: str
    precision: str  # what the engine trained in
    loss: float
    summed: float  # rank + 1 summed over the workers: workers * (workers + 1) / 2 when the all-reduce works


class NodeReport(BaseModel):
    """What the node a worker runs on offers ftflow's training."""

    gpu: str | None  # the device's name, None on a CPU worker
    bf16: bool | None  # whether that GPU computes in bf16
    cpu_adam: Literal["prebuilt", "cached", "jit", "no ninja"]  # how DeepSpeedCPUAdam (optimizer offload) would load
    extensions: str  # where a JIT build goes and is cached (TORCH_EXTENSIONS_DIR)


def one_step(spec: WorkerSpec, reports: Queue) -> None:
    """TorchTrainer's train function, its arguments bound by functools.partial: the WorkerSpec
    (tasks/doctor/checks.py fills it as tasks/train/driver.py does) and the queue each worker's
    StepReport goes to (Ray Train returns nothing)."""
    import deepspeed  # imported in the worker: it probes the accelerator at import

    deepspeed.utils.logger.setLevel(logging.WARNING)
    device = ray.train.torch.get_device()
    spec = resolve_precision(spec, device)
    join_process_group(device, spec.train.collective_timeout_s)
    torch.manual_seed(spec.train.seed)
    model = BertForSequenceClassification(TINY_BERT)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=spec.deepspeed)
    input_ids = torch.randint(0, TINY_BERT.vocab_size, (spec.plan.micro_batch, spec.max_length), device=device)
    labels = torch.randint(0, TINY_BERT.num_labels, (spec.plan.micro_batch,), device=device)
    loss = engine(input_ids=input_ids, labels=labels).loss
    engine.backward(loss)
    engine.step()
    summed = torch.tensor([dist.get_rank() + 1.0], device=device)  # NCCL reduces device tensors only
    dist.all_reduce(summed)
    reports.put(
        StepReport(
            rank=dist.get_rank(),
            device=str(device),
            backend=dist.get_backend(),
            precision=precision_of(engine),
            loss=loss.item(),
            summed=summed.item(),
        ).model_dump()
    )


def node_report() -> NodeReport:
    """Run as a Ray task where the workers run (on a GPU when the cluster has one)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from torch.utils.cpp_extension import _get_build_directory, is_ninja_available

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    # Where torch's JIT loader builds and finds the op (its own rule: TORCH_EXTENSIONS_DIR, else a
    # folder per Python and CUDA version); it creates the empty folder, as a build would.
    extensions = Path(_get_build_directory(builder.name, verbose=False))
    if (
        installed_ops.get(builder.name) and accelerator_name == get_accelerator()._name
    ):  # DeepSpeed's own test (OpBuilder.load)
        cpu_adam = "prebuilt"
    elif (extensions / f"{builder.name}.so").exists():
        cpu_adam = "cached"
    else:
        cpu_adam = "jit" if is_ninja_available() else "no ninja"
    return NodeReport(
        gpu=gpu,
        bf16=torch.cuda.is_bf16_supported() if gpu else None,
        cpu_adam=cpu_adam,
        extensions=str(extensions.parent),
    )
