"""`ftflow doctor`: what a run needs of the Ray cluster and of this machine, checked in about a minute,
one line per check. The cluster's checks run where the stages run (tasks/core/jobs.py: in this process, or
as a Ray Job when the address is the cluster's Job API); their workers' side is
tasks/doctor/worker.py. A check that raises or hangs is a failed line, never a traceback or a wait."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Literal, TypeVar

import ray
from pydantic import BaseModel
from ray.train import RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchConfig
from ray.util.queue import Queue

from tasks.core import cluster, jobs, storage
from tasks.core.config import DataConfig
from tasks.core.strict import first_line
from tasks.core.train_config import TrainConfig
from tasks.doctor.worker import SEQUENCE_LENGTH, TINY_BERT, NodeReport, StepReport, node_report, one_step
from tasks.train import Trainer, WorkerSpec, deepspeed_config, plan_of, worker_exception

T = TypeVar("T")
# Each Ray check's wait. Seen on a 2-core CPU machine that other jobs kept busy (load 2-15): a local
# Ray up in 7-30 s, the one-step job 20-60 s, the node's report 6-15 s. A first job on a GPU node also
# pays CUDA's and NCCL's set-up.
RAY_TIMEOUT_S = 30
STEP_TIMEOUT_S = 90
NODE_TIMEOUT_S = 30
# The cluster's checks as a whole, for what no check's own wait covers (a Ray Job that never starts).
CLUSTER_TIMEOUT_S = RAY_TIMEOUT_S + STEP_TIMEOUT_S + NODE_TIMEOUT_S + 30
PREFECT_TIMEOUT_S = 10
CLUSTER_CHECKS = ("ray", "train", "all-reduce", "bf16", "deepspeed ops")
MARKS = {"pass": "✓", "warn": "!", "skip": "-", "fail": "✗"}
SEE_LOG = "Ray's and DeepSpeed's own output is in the log file named last (--verbose prints it)"
FIXES = {
    "ray": "start the cluster, or set RAY_ADDRESS (--ray-address) to it: <head>:6379 on its network, http://<head>:8265 "
    "(its Job API) from outside",
    "train": SEE_LOG,
    "all-reduce": f"{SEE_LOG}; on GPUs NCCL_DEBUG=INFO shows NCCL's set-up",
    "bf16": SEE_LOG,
    "deepspeed ops": SEE_LOG,
}
CHECK_LINE = "ftflow-doctor-check: "  # a check, as JSON, on the cluster stage's log (Relay reads it back)
others = logging.getLogger(__name__)  # not under `ftflow`: tasks/core/jobs.py forwards that one, to Relay


class Check(BaseModel):
    """One line of the doctor's. A warning passes (a run works, slower the first time)."""

    name: str
    outcome: Literal["pass", "warn", "skip", "fail"]
    detail: str

    def line(self) -> str:
        return f"{MARKS[self.outcome]} {self.name}: {'skip: ' if self.outcome == 'skip' else ''}{self.detail}"


def failed(name: str, error: BaseException) -> Check:
    waited = (
        "`ray status` shows what Ray waits for; " if isinstance(error, TimeoutError) and name != "ray" else ""
    )  # connected, then waited
    return Check(
        name=name, outcome="fail", detail=f"{type(error).__name__}: {first_line(error)}; fix: {waited}{FIXES[name]}"
    )


def within(seconds: float, probe: Callable[[], T]) -> T:
    """probe(), or TimeoutError after `seconds`. A call blocked in Ray cannot be interrupted: it is
    left in a daemon thread, which the process's exit ends."""
    outcome: Future = Future()

    def call() -> None:
        try:
            outcome.set_result(probe())
        except BaseException as error:  # noqa: BLE001 -- handed to the caller, who says what failed
            outcome.set_exception(error)

    threading.Thread(target=call, daemon=True).start()
    try:
        return outcome.result(timeout=seconds)
    except TimeoutError:
        raise TimeoutError(f"no answer within {seconds:g} s") from None


def run(ray_address: str | None, storage_root: str, show: Callable[[Check], None]) -> bool:
    """Every check in order, each shown as it ends; whether none failed."""
    shown: list[Check] = []

    def record(check: Check) -> None:
        shown.append(check)
        show(check)

    def unchecked() -> list[str]:
        return [name for name in CLUSTER_CHECKS if name not in {check.name for check in shown}]

    address = ray_address or os.environ.get("RAY_ADDRESS")
    try:
        if not address:
            # A local Ray starts in this thread, not in within()'s: its processes end with the thread
            # that started them (seen: its GCS gone once that thread had ended, Ray's exit waiting on it).
            cluster.connect()
        elif not cluster.jobs_api(address):
            within(
                RAY_TIMEOUT_S, lambda: cluster.connect(address)
            )  # an address nothing answers on: ray.init waits minutes
        within(CLUSTER_TIMEOUT_S, lambda: jobs.run(on_cluster, address, Relay(record)))
    except Exception as error:  # noqa: BLE001 -- the cluster could not be reached, or its checks did not end
        if unchecked():
            record(failed(unchecked()[0], error))
    for name in unchecked():
        record(Check(name=name, outcome="skip", detail="not checked: the cluster failed the check above"))
    record(storage_check(storage_root))
    record(prefect_check())
    return all(check.outcome != "fail" for check in shown)


class Relay(logging.LoggerAdapter):
    """The logger tasks/core/jobs.py forwards the cluster stage's records to (from this process or from a
    Ray Job's log): each check to show(), as it ends; the rest to this module's logger."""

    def __init__(self, show: Callable[[Check], None]) -> None:
        super().__init__(others)
        self.show = show

    def log(self, level: int, msg: object, *args, **kwargs) -> None:
        if isinstance(msg, str) and msg.startswith(CHECK_LINE):
            self.show(Check.model_validate_json(msg.removeprefix(CHECK_LINE)))
        else:
            super().log(level, msg, *args, **kwargs)


def on_cluster() -> None:
    """The cluster's checks where the stages run (tasks/core/jobs.py), each logged as it ends; after a
    failed `ray`, no other (run() marks them not checked)."""
    reachable = guarded(("ray",), lambda: [within(RAY_TIMEOUT_S, ray_check)])
    logged(reachable)
    if reachable[0].outcome == "pass":
        # The node's report starts beside the step: its Ray worker's imports (torch, DeepSpeed) took 5.4 s
        # after the step here, of the doctor's 29 s.
        report = node_report_started()
        logged(guarded(("train", "all-reduce"), lambda: within(STEP_TIMEOUT_S, step_checks)))
        logged(guarded(("bf16", "deepspeed ops"), lambda: within(NODE_TIMEOUT_S, lambda: node_checks(report))))


def guarded(names: tuple[str, ...], probe: Callable[[], list[Check]]) -> list[Check]:
    """probe()'s checks, or each of `names` failed with the error's first line and its fix."""
    try:
        return probe()
    except Exception as error:  # noqa: BLE001 -- a check that raises is a failed line
        return [failed(name, error) for name in names]


def logged(checks: list[Check]) -> None:
    for check in checks:
        jobs.log.info(CHECK_LINE + check.model_dump_json())


def ray_check() -> Check:
    nodes = [node for node in ray.nodes() if node["Alive"]]
    resources = cluster.Resources.of_cluster()
    cpus = sum(node["Resources"].get("CPU", 0) for node in nodes)
    detail = (
        f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}, {cpus:g} CPUs, {resources.gpus} GPUs at "
        f"{ray.get_runtime_context().gcs_address}{', autoscaled' if resources.can_grow else ''}"
    )
    if resources.cpus < 1 and not resources.can_grow:  # ftflow leaves cluster.DATA_CPUS to Ray Data
        return Check(
            name="ray", outcome="fail", detail=f"{detail}: no CPU left for ftflow's workers; fix: add nodes with CPUs"
        )
    return Check(name="ray", outcome="pass", detail=detail)


def step_checks() -> list[Check]:
    """One DeepSpeed step on up to 2 of the cluster's devices, with the DeepSpeed JSON a run on them
    would use (tasks/train/plan.py and deepspeed_json.py, training's defaults); then the all-reduce."""
    resources = cluster.Resources.of_cluster()
    use_gpu = resources.use_gpu("auto")
    cfg = TrainConfig(
        num_workers=min(2, max(1, resources.gpus if use_gpu else int(resources.cpus))), collective_timeout_s=120
    )
    plan = plan_of(cfg, resources)
    spec = WorkerSpec(
        train=cfg,
        plan=plan,
        deepspeed=deepspeed_config(cfg, plan, total_steps=1, hidden_size=TINY_BERT.hidden_size),
        model="a tiny BERT, built in the worker",
        init="random",
        targets=DataConfig().targets,
        max_length=SEQUENCE_LENGTH,
        train_uri="",  # the one step's rows are made in the worker
        train_rows=1,
        batches_per_epoch=1,
        max_steps=1,
        model_uri="",
        adapter_uri="",
    )  # nothing is exported
    reports = Queue(actor_options={"num_cpus": 0})  # Ray Train returns nothing of the workers'
    trainer = Trainer(
        partial(one_step, spec, reports),
        scaling_config=ScalingConfig(
            num_workers=plan.workers, use_gpu=plan.use_gpu, resources_per_worker={"CPU": plan.cpus_per_worker}
        ),
        torch_config=TorchConfig(backend="nccl" if plan.use_gpu else "gloo", timeout_s=int(cfg.collective_timeout_s)),
        run_config=RunConfig(
            name="ftflow-doctor"
        ),  # Ray's default name is a new folder in ~/ray_results per run; nothing is kept
    )
    try:
        trainer.fit()
    except WorkerGroupError as error:  # Ray's message is "Training failed due to worker errors:", then tracebacks
        raise worker_exception(error) from None
    steps = sorted(
        (StepReport.model_validate(reports.get(timeout=5)) for _ in range(plan.workers)), key=lambda step: step.rank
    )
    device = "GPU" if plan.use_gpu else "CPU"
    trained = Check(
        name="train",
        outcome="pass",
        detail=f"one DeepSpeed step (ZeRO-{cfg.zero_stage}, {steps[0].precision}) of a tiny "
        f"BERT on {plan.workers} {device} worker(s): loss {steps[0].loss:.4f}",
    )
    return [trained, all_reduce_check(steps)]


def all_reduce_check(steps: list[StepReport]) -> Check:
    if len(steps) < 2:
        return Check(name="all-reduce", outcome="skip", detail="one device")
    expected = len(steps) * (len(steps) + 1) / 2
    wrong = [step.rank for step in steps if step.summed != expected]
    ran = (
        f"{len(steps)} workers over {steps[0].backend}, tensors on {', '.join(sorted({step.device for step in steps}))}"
    )
    if wrong:
        return Check(
            name="all-reduce",
            outcome="fail",
            detail=f"{ran}: the sum is wrong on rank(s) {wrong} (expected {expected:g}); fix: {FIXES['all-reduce']}",
        )
    return Check(name="all-reduce", outcome="pass", detail=f"{ran}: sum {expected:g} as expected")


def node_report_started() -> ray.ObjectRef:
    """The node's report, where the workers run: on a GPU when the cluster has one."""
    gpus = cluster.Resources.of_cluster().gpus
    return ray.remote(node_report).options(num_gpus=min(1, gpus)).remote()


def node_checks(report: ray.ObjectRef) -> list[Check]:
    """bf16 and DeepSpeed's CPU Adam, from the node's report."""
    node = ray.get(report)
    return [bf16_check(node), ops_check(node)]


def bf16_check(node: NodeReport) -> Check:
    if node.gpu is None:
        return Check(name="bf16", outcome="skip", detail="no GPU")
    if not node.bf16:
        return Check(name="bf16", outcome="warn", detail=f"{node.gpu} has no bf16: runs train in fp16 (precision=auto)")
    return Check(name="bf16", outcome="pass", detail=f"{node.gpu} computes in bf16")


def ops_check(node: NodeReport) -> Check:
    """Not prebuilt is a warning, not a failure: a run without optimizer offload needs no op, and one
    with it builds the op once (building it here would take the doctor's minute)."""
    adam = "CPU Adam (optimizer offload)"
    prebuild = (
        "prebuild it: `python infra/docker/build_ops.py CPUAdamBuilder` on the node, or DS_BUILD_CPU_ADAM=1 at DeepSpeed's "
        "install (infra/docker/Dockerfile)"
    )
    match node.cpu_adam:
        case "prebuilt":
            return Check(name="deepspeed ops", outcome="pass", detail=f"{adam} is prebuilt in DeepSpeed's install")
        case "cached":
            return Check(name="deepspeed ops", outcome="pass", detail=f"{adam} is built, in {node.extensions}")
        case "jit":
            return Check(
                name="deepspeed ops",
                outcome="warn",
                detail=f"{adam} is not prebuilt: the first run with offload_optimizer "
                f"builds it into {node.extensions} (~46 s on 2 cores); {prebuild}",
            )
    return Check(
        name="deepspeed ops",
        outcome="warn",
        detail=f"{adam} is not prebuilt, and without ninja it cannot be built: runs with "
        f"offload_optimizer fail; install ninja, or {prebuild}",
    )


def storage_check(storage_root: str) -> Check:
    try:
        storage.check_writable(storage_root, "storage_root")
    except Exception as error:  # noqa: BLE001 -- unreachable, no bucket, no credentials, not writable: its message says which
        return Check(
            name="storage",
            outcome="fail",
            detail=f"{first_line(error)}; fix: set --storage-root (or FTFLOW_STORAGE_ROOT) to a folder "
            "or s3://bucket/prefix this machine can write",
        )
    return Check(name="storage", outcome="pass", detail=f"{storage.normalize(storage_root)} is writable")


def prefect_check() -> Check:
    """The Prefect API at PREFECT_API_URL (the environment's, else the Prefect profile's) answers."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return Check(
            name="prefect",
            outcome="pass",
            detail="PREFECT_API_URL is not set: each run starts a temporary local Prefect server",
        )
    try:
        with get_client(httpx_settings={"timeout": PREFECT_TIMEOUT_S}, sync_client=True) as client:
            error = client.api_healthcheck()  # the exception, or None
    except Exception as raised:  # noqa: BLE001 -- a URL the client cannot use
        error = raised
    if error is not None:
        return Check(
            name="prefect",
            outcome="fail",
            detail=f"{url}/health: {first_line(error)}; fix: start the server (`ftflow stack up`, or "
            "`prefect server start`), or set PREFECT_API_URL to it",
        )
    return Check(name="prefect", outcome="pass", detail=f"{url} answers")
