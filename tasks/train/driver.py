"""Stage 2, the driver side (a Ray job on the cluster, no Prefect): plan the run (tasks/train/plan.py),
derive the DeepSpeed JSON (tasks/train/deepspeed_json.py), hand the streamed splits
(tasks/train/ingest.py) to Ray Train, and return what the workers (tasks/train/worker.py) recorded,
a Result (tasks/contracts/training.py)."""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import ray
from ray.train import (
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    UserCallback,
    WorkerGroupError,
)
from ray.train.torch import TorchConfig
from ray.train.v2._internal.constants import (
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
)
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

from tasks.contracts.training import SCORE, STATE_FILE, ClusterInfo, Result, TrainingJob
from tasks.core import cluster, jobs, storage
from tasks.core.layout import RunStore
from tasks.core.models import model_config
from tasks.core.progress import relayed
from tasks.core.train_config import TrainConfig
from tasks.train.deepspeed_json import deepspeed_config
from tasks.train.entry import train_worker
from tasks.train.ingest import EqualParts, split
from tasks.train.plan import cpu_has_native_bf16, planned
from tasks.train.resumable import latest_progress, resume_refused
from tasks.train.spec import Plan, Progress, WorkerSpec, digest_of
from tasks.train.trainer import RUN_NAME, Trainer, stop_controller, worker_exception
from tasks.train.watch import FailureRelay, Resizes, Watchdog

# glibc raises its mmap threshold to 32 MiB after the first large free, so tensors up to that size
# are then carved from the heap and fragment it: ZeRO-3's per-layer gathers grew a CPU worker's RSS
# by ~200 MiB in 4 steps. A fixed threshold hands every freed tensor above 64 KiB back to the OS, at
# the price of page faults on every allocation (-25% samples/s at ZeRO-2): so for ZeRO-3 only, the
# choice made to save memory.
ZERO3_WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}

# How often Ray Train's controller polls its workers, and its watcher the nodes' drain state (see ray_train_settings).
HEALTH_CHECK_INTERVAL_S = 0.5
PREEMPTION_POLL_INTERVAL_S = 1.0


def fit(job: TrainingJob) -> Result:
    """The stage's Ray work (tasks/core/jobs.py runs it where the cluster is): plan, then Ray Train."""
    return trained(jobs.log, job)


def trained(logger: logging.Logger, job: TrainingJob, callbacks: tuple[UserCallback, ...] = ()) -> Result:
    """One training run, for the train stage or a sweep's trial (whose callback reports to Ray Tune)."""
    cfg, choice, the_plan = planned(job.model, job.targets, job.train)  # refused before any worker starts
    if (progress := latest_progress(job.store.train_dir)) and (
        refused := resume_refused(progress, the_plan.workers, cfg)
    ):
        raise ValueError(refused)
    if choice:
        logger.info("strategy=auto: %s", choice.reason)
    train_rows, train_count, a_row = split(job.shards.train)
    spec = worker_spec(job, cfg, the_plan, train_count)
    if not callbacks and (done := finished_before(job.store, spec, progress)):
        logger.info(
            "training: an earlier attempt of this run trained it to its end (step %d) and exported it; "
            "no worker started",
            done.history[-1].step,
        )
        result = done.model_copy(update={"marks": None})  # no attempt ran now: the flow's phases have none
    else:
        say_plan(logger, spec)
        # The workers' ticks, lines and heartbeats, while training runs; a stall is reported under the run.
        with relayed(logger, Watchdog(logger, job.store.stall, cfg.stall_warning_s)) as channel:
            ingest = EqualParts(train_count, a_row)
            shuffled = train_rows.random_shuffle(seed=cfg.seed)
            trainer = build_trainer(spec, channel, shuffled, ingest, job.store, callbacks)
            ray_train_settings(spec)
            run(trainer, spec, job.store.train_dir)
        result = exported(job.store)
        warn_spread_groups(logger, result, cfg.tensor_parallel_size)
    log_history(logger, result)
    return result.model_copy(update={"cluster": cluster_info(), "strategy": choice})


def exported(store: RunStore) -> Result:
    """The Result the workers wrote beside the exported model."""
    return Result.model_validate(storage.read_json(storage.join(store.model_dir, STATE_FILE)))


def finished_before(store: RunStore, spec: WorkerSpec, progress: Progress | None) -> Result | None:
    """The Result an earlier attempt of this same spec exported, where its latest checkpoint is the one
    it exported from: a flow run retried after training (a later stage failed) re-runs the train task,
    and workers would start (~15 s here) to train no step and export the same model again. A sweep's
    trials are not asked: Ray Tune keeps their state and runs again only those it has not seen end."""
    if progress is None or not storage.exists(storage.join(store.model_dir, STATE_FILE)):
        return None
    result = exported(store)
    same = result.spec_digest == spec.digest and result.history and result.history[-1].step == progress.step
    return result if same else None


def cluster_info() -> ClusterInfo:
    """The cluster this process is connected to."""
    resources = cluster.Resources.of_cluster()
    return ClusterInfo(
        gcs_address=ray.get_runtime_context().gcs_address,
        nodes=len(ray.nodes()),
        cpus=resources.cpus,
        gpus=resources.gpus,
    )


def worker_spec(job: TrainingJob, cfg: TrainConfig, the_plan: Plan, train_count: int) -> WorkerSpec:
    """What every worker is told: the job's config as it trains (`cfg`: strategy=auto resolved), the
    plan, the DeepSpeed JSON, the steps, and the splits it evaluates on (the test split, where there is
    one, the trained engine labels: Result.test)."""
    shards, model = job.shards, job.model
    evaluation = {name: uri for name, uri in (("validation", shards.validation), ("test", shards.test)) if uri}
    padded_rows = train_count + -train_count % the_plan.workers
    batches_per_epoch = math.ceil(padded_rows / the_plan.workers / the_plan.micro_batch)
    max_steps = min(cfg.max_steps or math.inf, cfg.epochs * (batches_per_epoch // the_plan.accumulation))
    hidden_size = model_config(model.name_or_path).get("hidden_size", 768)
    spec = WorkerSpec(
        train=cfg,
        plan=the_plan,
        deepspeed=deepspeed_config(cfg, the_plan, max_steps, hidden_size),
        model=model.name_or_path,
        init=model.init,
        targets=job.targets,
        max_length=model.max_length,
        train_uri=shards.train,
        train_rows=train_count,
        batches_per_epoch=batches_per_epoch,
        max_steps=max_steps,
        model_uri=job.store.model_dir,
        adapter_uri=job.store.adapter_dir,
        evaluation=evaluation,
        preemptible=not cluster.local_ray(),
    )
    return spec.model_copy(update={"digest": digest_of(spec)})


def say_plan(logger: logging.Logger, spec: WorkerSpec) -> None:
    logger.info("training on %s, %d steps", spec.plan.describe(spec.train), spec.max_steps)
    if spec.plan.precision == "bf16" and not spec.plan.use_gpu and not cpu_has_native_bf16():  # a hint
        logger.warning(
            "precision=bf16 on a CPU without native bf16 (avx512_bf16, amx): it trains, but ~2.4x slower than fp32"
        )


def build_trainer(
    spec: WorkerSpec,
    channel: str,
    train_rows,
    ingest: EqualParts,
    store: RunStore,
    callbacks: tuple[UserCallback, ...] = (),
) -> Trainer:
    """Ray Train's trainer for the spec: its workers, their process group, the stream, checkpoints."""
    cfg, the_plan = spec.train, spec.plan
    storage_path, filesystem = storage.pyarrow_filesystem(store.train_dir)
    return Trainer(
        partial(train_worker, spec.model_copy(update={"channel": channel})),
        datasets={"train": train_rows},
        dataset_config=ingest,
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers if isinstance(cfg.num_workers, tuple) else the_plan.workers,
            elastic_resize_monitor_interval_s=cfg.grow_every_s,
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
            name=RUN_NAME,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            worker_runtime_env={"env_vars": ZERO3_WORKER_ENV if cfg.zero_stage == 3 else {}},
            checkpoint_config=checkpoint_config(cfg),
            # A controller failure is the worker group not starting: retried, it would wait forever.
            failure_config=FailureConfig(max_failures=cfg.max_failures, controller_failure_limit=0),
            # each failure and each resize said at once, not only in Ray's log
            callbacks=[relay := FailureRelay(channel, cfg.max_failures), Resizes(relay), *callbacks],
        ),
    )


def checkpoint_config(cfg: TrainConfig) -> CheckpointConfig:
    """Ray Train always keeps the latest checkpoint (resume); besides it the last two, or with keep_best
    the two that validated best (the worker reloads the best at the end)."""
    if not cfg.keep_best:
        return CheckpointConfig(num_to_keep=2)
    return CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=SCORE, checkpoint_score_order="max")


def ray_train_settings(spec: WorkerSpec) -> None:
    """Ray Train reads how long a worker group may take to start, and how often its controller polls
    the workers, from the driver's environment (it passes them to its controller); no parameter sets
    them. The default poll, every 2 s, left the run up to 2 s behind its finished workers. Ray Train
    2.60 also starts an actor that polls the nodes' drain state for preemptions, and the workers wait
    for it: a process of its own, 1.9 s of a 2-worker start on the local Ray, where no node can be
    preempted. On a cluster it looks every 1 s, not Ray's 5: the notice's checkpoint gets 4 s more of the
    node's drain window (30 s by default)."""
    os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(spec.train.wait_for_workers_s)
    os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR] = str(HEALTH_CHECK_INTERVAL_S)
    os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "1" if spec.preemptible else "0"
    os.environ[PREEMPTION_POLL_INTERVAL_S_ENV_VAR] = str(PREEMPTION_POLL_INTERVAL_S)


def run(trainer: Trainer, spec: WorkerSpec, train_dir: str) -> None:
    """trainer.fit(); interrupted (train.timeout_s, Ctrl-C), the run stops with it.

    fit() runs in a thread of its own and this one waits on it, a second at a time: Ray's `ray.get`,
    which fit() blocks in until training ends, runs a signal's handler but lets no exception it raises
    through, so Prefect's timeout ended a 15 s-limited run only when its 140 s of training were done.
    Prefect's timeout is an alarm in the main thread, and elsewhere an exception set on the thread,
    which is raised only when the thread runs Python: this loop does, every second. Interrupted, the
    run's controller is ended, and its workers with it."""
    fitting = ThreadPoolExecutor(1, thread_name_prefix="ray-train-fit")
    fit = fitting.submit(trainer.fit)
    try:
        while not fit.done():
            wait([fit], timeout=1)
        fitted(fit, spec)
    finally:
        if not fit.done():
            stop_controller(train_dir)
        fitting.shutdown(wait=False)


def fitted(fit: Future, spec: WorkerSpec) -> None:
    """fit()'s end, its failures in the words of what failed: the worker's own exception, the cluster
    that made no room for the workers, or a loss no longer finite."""
    try:
        diverged = fit.result().return_value  # rank 0's (tasks/train/worker.py `train_worker`)
    except WorkerGroupError as error:  # the last attempt failed: the worker's own exception, not Ray's wrapper
        raise worker_exception(error) from None
    except ControllerError as error:
        if not isinstance(error.controller_failure, WorkerGroupStartupTimeoutError):
            raise
        the_plan, gpu = spec.plan, " and 1 GPU" if spec.plan.use_gpu else ""
        raise RuntimeError(
            f"the Ray cluster did not make room for {the_plan.workers} training worker(s) of {the_plan.cpus_per_worker:g} CPU"
            f"{gpu} each within wait_for_workers_s={spec.train.wait_for_workers_s:g}: no node can hold one, or none was "
            "added in time; see `ray status`"
        ) from None
    if diverged:
        raise FloatingPointError(diverged)


def warn_spread_groups(logger: logging.Logger, result: Result, tp: int) -> None:
    if spread := [rank for rank in range(0, len(result.nodes), tp) if len(set(result.nodes[rank : rank + tp])) > 1]:
        logger.warning(
            "the tensor-parallel group(s) of ranks %s spanned nodes: their all-reduces crossed the network (a "
            "cluster that grows places groups as Ray packs them: give its nodes room for whole groups)",
            spread,
        )


def log_history(logger: logging.Logger, result: Result) -> None:
    if result.stopped.startswith("early stopping"):
        logger.info("training stopped: %s", result.stopped)
    if result.kept and result.kept.step != result.history[-1].step:
        logger.info("exported step %d: %s", result.kept.step, result.kept.reason)
    for row in result.history:
        accuracy = f" val_accuracy {row.val_accuracy:.4f}" if row.val_accuracy is not None else ""
        accuracy += f" val_entity_f1 {row.val_entity_f1:.4f}" if row.val_entity_f1 is not None else ""
        logger.info(
            "epoch %g step %d: train_loss %.4f val_loss %.4f%s (%.1f samples/s, peak %.0f MiB per worker)%s",
            row.epoch,
            row.step,
            row.train_loss,
            row.val_loss,
            accuracy,
            row.samples_per_s,
            row.peak_memory_mb,
            f", resumed from step {row.resumed_from_step} on {row.workers} worker(s)" if row.resumed_from_step else "",
        )
