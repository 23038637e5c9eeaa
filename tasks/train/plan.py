"""Stage 2's plan, before any worker starts: strategy=auto resolved, then device, workers,
micro-batch, accumulation and precision on this cluster, or what to change, in one line."""

from __future__ import annotations

from pathlib import Path

from tasks.contracts.training import Choice
from tasks.core import cluster
from tasks.core.config import ModelConfig
from tasks.core.models import check_parallelism
from tasks.core.targets import Targets
from tasks.core.train_config import TrainConfig
from tasks.train import strategy
from tasks.train.spec import Plan


def cpu_has_native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def worker_cpus(cfg: TrainConfig, resources: cluster.Resources, use_gpu: bool) -> float:
    """cpus_per_worker, else 1 beside a GPU or on a cluster of several nodes (or one that grows); on
    one machine's CPUs all of ftflow's share, or with num_workers set (or a tensor-parallel group to
    make), that share divided among them. On one 2-core machine 1 worker x 2 threads trained 1.16x
    faster than 2 workers x 1 thread (bench/RESULTS.md): no gradient all-reduce, no step waiting for
    the slower worker."""
    if cfg.cpus_per_worker or use_gpu or resources.can_grow or resources.node_cpus < resources.cpus:
        return cfg.cpus_per_worker or 1
    return max(1, int(min(resources.cpus, resources.node_cpus) // (cfg.most_workers or cfg.model_parallel)))


def plan_of(cfg: TrainConfig, resources: cluster.Resources) -> Plan:
    """Resolve device, workers, micro-batch, accumulation and precision, or say what to change. With a
    range of workers, the plan is for the most; the fewest must fit now or once the cluster grows, and a
    worker group of another size plans itself (Plan.at)."""
    use_gpu = resources.use_gpu(cfg.device)
    cpus_per_worker = worker_cpus(cfg, resources, use_gpu)
    if isinstance(cfg.num_workers, tuple):
        resources.training_workers(cfg.num_workers[0], cpus_per_worker, use_gpu)  # the fewest fit, or will
        workers = cfg.num_workers[1]
    else:
        workers = resources.training_workers(cfg.num_workers, cpus_per_worker, use_gpu)
    group = cfg.model_parallel
    if cfg.num_workers is None:
        fits, workers = workers, max(group, workers - workers % group)  # whole groups
        if workers > fits and not resources.can_grow:
            raise ValueError(
                f"{cfg.split_field}={group} needs {group} workers and the Ray cluster fits {fits}: "
                f"use a smaller {cfg.split_field}, or a larger cluster"
            )
    if error := cfg.split_error(workers):
        raise ValueError(error)
    micro = cfg.micro_batch_size or cfg.batch_size // workers
    if not use_gpu and cfg.precision == "fp16":
        raise ValueError("precision=fp16 needs a GPU and this run trains on CPUs: use fp32 (or auto), or device=gpu")
    if not use_gpu and cfg.activation_offload:
        raise ValueError(
            "activation_offload moves GPU activations to CPU memory and this run trains on CPUs: set it false, or device=gpu"
        )
    precision = "fp32" if cfg.precision == "auto" and not use_gpu else cfg.precision
    return Plan(
        workers=workers,
        cpus_per_worker=cpus_per_worker,
        micro_batch=micro,
        accumulation=cfg.batch_size // (workers * micro),
        use_gpu=use_gpu,
        precision=precision,
    )


def resolved(
    cfg: TrainConfig, model: ModelConfig, targets: Targets, resources: cluster.Resources
) -> tuple[TrainConfig, Choice | None]:
    """The config as it trains: with strategy=auto, the fastest candidate (tasks/train/strategy.py) whose
    estimated need per worker, as `plan_of` would run it here, is within the memory a worker has."""
    if cfg.strategy == "manual":
        return cfg, None
    size, use_gpu = strategy.ModelSize.of(model.name_or_path, targets.width), resources.use_gpu(cfg.device)
    per_cpu = strategy.memory_per_cpu(use_gpu) if cfg.memory_per_worker_gb is None else None
    gpu = strategy.gpu_memory() if use_gpu and cfg.memory_per_worker_gb is None else None
    options = []
    for candidate in strategy.candidates(cfg, use_gpu):
        try:
            check_parallelism(candidate, model, targets.task)
            the_plan = plan_of(candidate, resources)
        except ValueError:  # a split this model, or this cluster, cannot take
            continue
        if the_plan.cpus_per_worker * candidate.tensor_parallel_size > resources.node_cpus:
            continue  # a group no node holds
        budget = (
            int(cfg.memory_per_worker_gb * strategy.GIB)
            if cfg.memory_per_worker_gb
            else gpu or int(per_cpu * the_plan.cpus_per_worker)
        )
        need = strategy.need_bytes(size, candidate, the_plan.workers, the_plan.micro_batch, model.max_length, use_gpu)
        options.append((candidate, need, budget))
    return strategy.pick(options)


def planned(model: ModelConfig, targets: Targets, cfg: TrainConfig) -> tuple[TrainConfig, Choice | None, Plan]:
    """The config as it trains (strategy=auto resolved), why, and its plan on this cluster; or what to change."""
    check_parallelism(cfg, model, targets.task)
    resources = cluster.Resources.of_cluster()
    cfg, choice = resolved(cfg, model, targets, resources)
    return cfg, choice, plan_of(cfg, resources)


def check_plan(model: ModelConfig, targets: Targets, cfg: TrainConfig) -> None:
    """check_training_plan's Ray work (tasks/core/jobs.py runs it where the cluster is)."""
    planned(model, targets, cfg)
