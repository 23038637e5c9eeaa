"""Stage 2, the driver side (a Ray job on the cluster, no Prefect): plan the run on the cluster, derive
the DeepSpeed JSON, hand the streamed splits to Ray Train, and return what the workers
(tasks/train/worker.py) recorded, a Result (tasks/train/contract.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset
import ray
from ray.data import DataContext
from ray.train import (
    CheckpointConfig,
    ControllerError,
    DataConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    WorkerGroupError,
)
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.constants import (
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
)
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from transformers import AutoConfig

from tasks.core import cluster, jobs, storage
from tasks.core.config import ModelConfig, TrainConfig, hub_free
from tasks.core.first_token import FIRST_TOKEN_CLASSIFIERS
from tasks.core.progress import relayed
from tasks.core.storage import RunStore
from tasks.tokenize.worker import SHARD_SCHEMA
from tasks.train import strategy
from tasks.train.contract import IGNORED, STATE_FILE, Choice, EvaluationSplit, Fault, Plan, Result, WorkerSpec
from tasks.train.entry import train_worker
from tasks.train.watch import FailureRelay, Watchdog, own

# glibc raises its mmap threshold to 32 MiB after the first large free, so tensors up to that size
# are then carved from the heap and fragment it: ZeRO-3's per-layer gathers grew a CPU worker's RSS
# by ~200 MiB in 4 steps. A fixed threshold hands every freed tensor above 64 KiB back to the OS, at
# the price of page faults on every allocation (-25% samples/s at ZeRO-2): so for ZeRO-3 only, the
# choice made to save memory.
ZERO3_WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}

# Blocks of the training stream: Ray Data cuts them at 128 MiB, and a shuffle's output blocks are
# large, so a worker waited on a few big reduce tasks: at 1M tiny-model rows, 0.47x the samples/s
# of the in-memory loader, 1.01x with blocks of at most 16 MiB (bench/training_data.py).
BLOCK_BYTES = 16 * 2**20

# Models AutoTP splits as ftflow has seen it train and export (tests/test_train.py): BERT's layer
# and its copies, with query, key, value and the intermediate split by columns, the attention output
# and the output by rows. The pooler and the classifier stay whole on every worker.
SPLITTABLE = FIRST_TOKEN_CLASSIFIERS

# How often Ray Train's controller polls its workers (see fit).
HEALTH_CHECK_INTERVAL_S = 0.5
# What the tests turn on in the workers, from the driver's environment: every collective's tensor
# checked against the training device (tasks/train/devices.py), and a fault at a step (train_worker.Fault).
CHECK_DEVICES, FAULT = "FTFLOW_TEST_CHECK_DEVICES", "FTFLOW_TEST_FAULT"


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
    return max(1, int(min(resources.cpus, resources.node_cpus) // (cfg.num_workers or cfg.model_parallel)))


def check_parallelism(cfg: TrainConfig, model: ModelConfig) -> None:
    """Refuse a split that the model cannot take, saying what to change, before any cluster work."""
    if cfg.model_parallel == 1:
        return
    name, size = cfg.split_field, cfg.model_parallel
    config = AutoConfig.from_pretrained(model.name_or_path, **hub_free(model.name_or_path))
    if config.model_type not in SPLITTABLE:
        raise ValueError(
            f"train.{name}={size}: {model.name_or_path} is a '{config.model_type}' model, and ftflow "
            f"splits BERT-family encoders only ({', '.join(sorted(SPLITTABLE))}): set it to 1"
        )
    fields = ("num_attention_heads", "intermediate_size") if name == "tensor_parallel_size" else ("num_hidden_layers",)
    for field in fields:
        if getattr(config, field) % size:
            raise ValueError(
                f"train.{name}={size} does not divide the model's {field}={getattr(config, field)}: "
                f"use a divisor of {getattr(config, field)}"
            )


def plan(cfg: TrainConfig, resources: cluster.Resources) -> Plan:
    """Resolve device, workers, micro-batch, accumulation and precision, or say what to change."""
    use_gpu = resources.use_gpu(cfg.device)
    cpus_per_worker = worker_cpus(cfg, resources, use_gpu)
    workers, group = resources.training_workers(cfg.num_workers, cpus_per_worker, use_gpu), cfg.model_parallel
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
    cfg: TrainConfig, model: ModelConfig, labels: int, resources: cluster.Resources
) -> tuple[TrainConfig, Choice | None]:
    """The config as it trains: with strategy=auto, the fastest candidate (tasks/train/strategy.py) whose
    estimated need per worker, as `plan` would run it here, is within the memory a worker has."""
    if cfg.strategy == "manual":
        return cfg, None
    size, use_gpu = strategy.ModelSize.of(model.name_or_path, labels), resources.use_gpu(cfg.device)
    per_cpu = strategy.memory_per_cpu(use_gpu) if cfg.memory_per_worker_gb is None else None
    gpu = strategy.gpu_memory() if use_gpu and cfg.memory_per_worker_gb is None else None
    options = []
    for candidate in strategy.candidates(cfg, use_gpu):
        try:
            check_parallelism(candidate, model)
            the_plan = plan(candidate, resources)
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


def merge(base: dict, override: dict) -> dict:
    """Deep merge: the expert's raw DeepSpeed keys win, nested sections are merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
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
        zero |= {
            "reduce_bucket_size": hidden_size**2,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size**2),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": layer,
            "stage3_max_reuse_distance": layer,
        }
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
        # DeepSpeed's throughput timer synchronizes the device at every forward and every step by
        # default: the host then waits for the GPU instead of queueing the next kernels. ftflow
        # measures its own samples/s (tasks/train/worker.py's Meter) without a sync per step.
        "timers": {"throughput": {"enabled": False}},
    }
    if cfg.tensor_parallel_size > 1:
        derived["tensor_parallel"] = {"autotp_size": cfg.tensor_parallel_size}
    if cfg.model_parallel > 1:
        # DeepSpeed 0.19.8 checks train_batch_size against micro-batch x accumulation x ranks where
        # it builds an AutoTP engine, against data-parallel ranks alone where ZeRO-3 partitions
        # AutoTP's new layers (zero.Init) and where it builds a pipeline engine: no value passes
        # them all, and ftflow's replicas join their ranks' micro-batches anyway. Left out, each
        # check derives it from the other two.
        del derived["train_batch_size"]
    return merge(derived, cfg.deepspeed)


@contextmanager
def parquet_reader_v1() -> Iterator[None]:
    """Ray Data 2.60 reads Parquet through its datasource V2 unless told otherwise, and V2 lists the
    files in a stage of its own at every pass: a pass over the main job's 8,530 rows took 1.2-2.5 s
    with V2 and 0.07-0.14 s with V1, and training makes a pass per epoch and per validation. The
    choice is taken when the dataset is made, from the process's context: set for that moment only."""
    context = DataContext.get_current()
    v2, context.use_datasource_v2 = context.use_datasource_v2, False
    try:
        yield
    finally:
        context.use_datasource_v2 = v2


def split(uri: str, workers: int) -> tuple[ray.data.Dataset, int]:
    """A tokenized split as a lazy Ray Data stream of its Parquet shards, padded with ignored rows
    (row -1, label IGNORED, one token) to a multiple of the workers: Ray Train's equal split would
    otherwise drop the remainder, and an unequal one leaves a worker's collectives waiting. Returns
    it with its real row count, from the Parquet footers (Ray Data's count() runs a pipeline: 1.8 s
    of the main job's start, for the same 8530 rows)."""
    path, filesystem = storage.pyarrow_filesystem(uri)
    with parquet_reader_v1():
        rows = ray.data.read_parquet(path, filesystem=filesystem, file_extensions=["parquet"])
    rows.context.target_max_block_size = BLOCK_BYTES  # this stream's context: the read and the shuffle after it
    count = rows_in(uri)
    padding = -count % workers
    if padding:
        rows = rows.union(
            ray.data.from_arrow(
                pa.table(
                    {"row": [-1] * padding, "label": [IGNORED] * padding, "input_ids": [[0]] * padding},
                    schema=SHARD_SCHEMA,
                )
            )
        )
    return rows, count


def rows_in(uri: str) -> int:
    """A tokenized split's rows, from its Parquet footers."""
    path, filesystem = storage.pyarrow_filesystem(uri)
    return pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet").count_rows()


def worker_exception(error: WorkerGroupError) -> BaseException:
    """The lowest failed rank's own exception, its traceback (from the worker) kept as a note."""
    rank, failure = min(error.worker_failures.items())
    exception = own(failure)
    exception.add_note(f"raised by training worker {rank}" + (f":\n{failure}" if failure is not exception else ""))
    return exception


class Trainer(TorchTrainer):
    """Ray Train's TorchTrainer, without its placement-group cleaner on a cluster with no dashboard (the
    local Ray ftflow starts).

    The cleaner (Ray 2.60) asks the dashboard's state API every second whether the training controller
    lives, to remove its placement group if it died. With no dashboard it can never know: each ask
    searched this machine's Ray processes for 40 s, and its stop at the end of every fit() waited out
    its 12 s timeout (bench/local_fit.py). On the local Ray, ftflow's reaper (tasks/core/reaper.py)
    ends the whole Ray with its driver, placement groups included. Ray Train has no option to leave
    the cleaner out, hence this override of its default callbacks.
    """

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        if not local_ray():
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, PlacementGroupCleanerCallback)]


def local_ray() -> bool:
    """The local Ray ftflow starts (tasks/core/cluster.py), known by its lack of a dashboard: one
    machine, no node to lose to a preemption, and a reaper that ends it with its driver."""
    return not ray._private.worker.get_dashboard_url()


def data_config() -> DataConfig:
    """Ray Train's ingest with the blocks kept in order, so that the split each worker gets, and so
    the order of every epoch, follows from the seed alone (Ray hands blocks out as they come)."""
    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(execution_options=options)


def planned(model: ModelConfig, label_names: list[str], cfg: TrainConfig) -> tuple[TrainConfig, Choice | None, Plan]:
    """The config as it trains (strategy=auto resolved), why, and its plan on this cluster; or what to change."""
    check_parallelism(cfg, model)
    resources = cluster.Resources.of_cluster()
    cfg, choice = resolved(cfg, model, len(label_names), resources)
    return cfg, choice, plan(cfg, resources)


def check_plan(model: ModelConfig, label_names: list[str], cfg: TrainConfig) -> None:
    """check_training_plan's Ray work (tasks/core/jobs.py runs it where the cluster is)."""
    planned(model, label_names, cfg)


def fit(
    tokenized: dict[str, str], model: ModelConfig, label_names: list[str], cfg: TrainConfig, store: RunStore
) -> Result:
    """The stage's Ray work (tasks/core/jobs.py runs it where the cluster is): plan, then Ray Train."""
    logger = jobs.log
    cfg, choice, the_plan = planned(model, label_names, cfg)  # refuse what cannot run before any worker starts
    if choice:
        logger.info("strategy=auto: %s", choice.reason)
    train_rows, train_count = split(tokenized["train"], the_plan.workers)
    # Each worker reads its rows of these (tasks/train/batches.py); the test split, where there is one,
    # the trained engine labels for evaluation (Result.test).
    evaluation = {
        name: EvaluationSplit(uri=tokenized[name], rows=rows_in(tokenized[name]))
        for name in ("validation", "test")
        if name in tokenized
    }
    batches_per_epoch = math.ceil(
        (train_count + -train_count % the_plan.workers) / the_plan.workers / the_plan.micro_batch
    )
    max_steps = min(cfg.max_steps or math.inf, cfg.epochs * (batches_per_epoch // the_plan.accumulation))
    hidden_size = getattr(
        AutoConfig.from_pretrained(model.name_or_path, **hub_free(model.name_or_path)), "hidden_size", 768
    )
    spec = WorkerSpec(
        train=cfg,
        plan=the_plan,
        deepspeed=deepspeed_config(cfg, the_plan, max_steps, hidden_size),
        model=model.name_or_path,
        label_names=label_names,
        max_length=model.max_length,
        batches_per_epoch=batches_per_epoch,
        max_steps=max_steps,
        model_uri=store.model_dir,
        evaluation=evaluation,
    )
    storage_path, filesystem = storage.pyarrow_filesystem(store.train_dir)
    logger.info("training on %s, %d steps", the_plan.describe(cfg), max_steps)
    if (
        the_plan.precision == "bf16" and not the_plan.use_gpu and not cpu_has_native_bf16()
    ):  # this machine's CPU, as a hint
        logger.warning(
            "precision=bf16 on a CPU without native bf16 (avx512_bf16, amx): it trains, but ~2.4x slower than fp32"
        )
    fault = Fault.model_validate_json(os.environ[FAULT]).model_dump() if os.environ.get(FAULT) else None
    # The workers' ticks, lines and heartbeats, while training runs; a stall is reported under the run.
    with relayed(logger, Watchdog(logger, store.stall, cfg.stall_warning_s)) as channel:
        trainer = Trainer(
            train_worker,
            train_loop_config={
                "spec": spec.model_dump(),
                "channel": channel,
                "fault": fault,
                "check_devices": os.environ.get(CHECK_DEVICES) == "1",
            },
            datasets={"train": train_rows.random_shuffle(seed=cfg.seed)},
            dataset_config=data_config(),
            scaling_config=ScalingConfig(
                num_workers=the_plan.workers,
                use_gpu=the_plan.use_gpu,
                resources_per_worker={"CPU": the_plan.cpus_per_worker},
                label_selector=cluster.groups_on_nodes(
                    the_plan.workers, cfg.tensor_parallel_size, the_plan.cpus_per_worker, the_plan.use_gpu
                ),
            ),
            torch_config=TorchConfig(
                backend="nccl" if the_plan.use_gpu else "gloo", timeout_s=int(cfg.collective_timeout_s)
            ),
            run_config=RunConfig(
                name="ray",
                storage_path=storage_path,
                storage_filesystem=filesystem,
                worker_runtime_env={"env_vars": ZERO3_WORKER_ENV if cfg.zero_stage == 3 else {}},
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                # A controller failure is the worker group not starting: retried, it would wait forever.
                failure_config=FailureConfig(max_failures=cfg.max_failures, controller_failure_limit=0),
                callbacks=[FailureRelay(channel, cfg.max_failures)],  # each failure said at once, not only in Ray's log
            ),
        )
        # Ray Train reads how long a worker group may take to start, and how often its controller polls
        # the workers, from the driver's environment (it passes them to its controller); no parameter
        # sets them. The default poll, every 2 s, left the run up to 2 s behind its finished workers.
        os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(cfg.wait_for_workers_s)
        os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR] = str(HEALTH_CHECK_INTERVAL_S)
        # Ray Train 2.60 starts an actor that polls the nodes' drain state for preemptions, and the
        # workers wait for it: a process of its own, 1.9 s of a 2-worker start on the local Ray, where
        # no node can be preempted.
        os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "0" if local_ray() else "1"
        try:
            trainer.fit()
        except WorkerGroupError as error:  # the last attempt failed: the worker's own exception, not Ray's wrapper
            raise worker_exception(error) from None
        except ControllerError as error:
            if not isinstance(error.controller_failure, WorkerGroupStartupTimeoutError):
                raise
            gpu = " and 1 GPU" if the_plan.use_gpu else ""
            raise RuntimeError(
                f"the Ray cluster did not make room for {the_plan.workers} training worker(s) of {the_plan.cpus_per_worker:g} CPU"
                f"{gpu} each within wait_for_workers_s={cfg.wait_for_workers_s:g}: no node can hold one, or none was "
                "added in time; see `ray status`"
            ) from None
    result = Result.model_validate(storage.read_json(storage.join(store.model_dir, STATE_FILE)))
    tp = cfg.tensor_parallel_size
    if spread := [rank for rank in range(0, len(result.nodes), tp) if len(set(result.nodes[rank : rank + tp])) > 1]:
        logger.warning(
            "the tensor-parallel group(s) of ranks %s spanned nodes: their all-reduces crossed the network (a "
            "cluster that grows places groups as Ray packs them: give its nodes room for whole groups)",
            spread,
        )
    for row in result.history:
        logger.info(
            "epoch %g step %d: train_loss %.4f val_loss %.4f val_accuracy %.4f (%.1f samples/s, peak %.0f MiB per worker)%s",
            row.epoch,
            row.step,
            row.train_loss,
            row.val_loss,
            row.val_accuracy,
            row.samples_per_s,
            row.peak_memory_mb,
            f", resumed from step {row.resumed_from_step}" if row.resumed_from_step else "",
        )
    return result.model_copy(update={"cluster": cluster.describe(), "strategy": choice})
