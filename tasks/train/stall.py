"""The stall report of a training run that stopped making progress.

When no worker heartbeat has come for a while, the training driver (tasks/train/driver.py) calls report()
once: it gathers into a folder what tells where the run waits, and returns the stuck worker's top
stack frame for the one warning the driver prints. The folder:

    README.md               what is where, and what could not be collected
    stacks/<what>.txt       `py-spy dump` of every training worker, of Ray Train's controller actor
                            (TrainController) and of Ray Data's split coordinator actor(s) (SplitCoordinator)
    environment.json        each training worker's NCCL_*, CUDA_*, HF_*, TORCH_NCCL_* settings, credentials redacted
    nvidia-smi/<node>.txt   per node that holds a training worker, where nvidia-smi is installed
    cluster.json            free and total resources, per node too, placement groups still waiting, the nodes
    dead.json               this job's dead actors and dead workers, with their death cause
    logs/<name>.out|.err    the last lines of the training workers' and the dead processes' log files

Ray's state API (ray.util.state) asks the dashboard, which the local Ray ftflow starts does not run
(seen: ServerUnavailable at once), so the tables are read from the GCS (ray._private.state, what
`ray.nodes()` uses), and what only a node can see (py-spy, nvidia-smi, /proc, log files) is
gathered by one task per node, all at once. Those tasks take no CPU: a cluster whose CPUs are all
held may be why the run stalled. Nothing here raises: a part that fails is named in README.md and
the training run goes on. Credentials never reach the folder: settings whose name says they are
secret are shown as <redacted>, and their values are cut from every text written (a worker may
have logged one).

This module imports no Prefect.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import ray
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict
from ray._private import state
from ray.core.generated import common_pb2, gcs_pb2
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tasks.core import storage
from tasks.train.stall_node import (
    REDACTED,
    SETTINGS,
    TAIL_LINES,
    NodeReport,
    Probed,
    attempt,
    on_node,
    secret_values,
)

log = logging.getLogger(__name__)

NODE_TIMEOUT_S = 15.0  # a node that has not answered by then is named as silent: the report stays well under 30 s
MAX_DEAD = 8  # the most recent dead processes reported: a long run's retries can leave many
# Ray's names for the actors a stalled run may wait on (Ray 2.60: ray/train/v2/_internal/execution/controller,
# ray/data/_internal/iterator/stream_split_iterator.py).
RAY_ACTORS = {"TrainController": "controller", "SplitCoordinator": "split coordinator"}
# Worker exits worth reporting: Ray ends idle workers itself (INTENDED_SYSTEM_EXIT) all the time.
UNEXPECTED_EXITS = {common_pb2.SYSTEM_ERROR, common_pb2.USER_ERROR, common_pb2.NODE_OUT_OF_MEMORY}
# Actor ends that are someone's intent, not a failure: an earlier stage's actor pool released or killed.
DELIBERATE_ENDS = {
    common_pb2.ActorDiedErrorContext.OUT_OF_SCOPE,
    common_pb2.ActorDiedErrorContext.REF_DELETED,
    common_pb2.ActorDiedErrorContext.RAY_KILL,
}


class Process(BaseModel):
    """A process of the run, by where it runs."""

    model_config = ConfigDict(frozen=True)

    what: str  # "rank 0", "rank 1", ... for training workers; names its files
    node_id: str  # Ray node id (hex) where it runs
    pid: int


def report(folder: str, workers: list[Process], stuck: Process | None = None) -> str:
    """Write the stall report under `folder` (a local path or an s3:// URI) and return the top stack frame
    of `stuck`'s training thread as one short line, e.g. "all_reduce (torch/distributed/distributed_c10d.py:2810)",
    '' when unknown. Never raises."""
    started = time.monotonic()
    out = Folder(folder)
    try:
        frame = gather(out, workers, stuck)
    except Exception as error:  # a fault of this module's own: the training run must not end on it
        log.warning("stall report: %s", error, exc_info=True)
        out.failures.append(f"report: {type(error).__name__}: {error}")
        frame = ""
    out.summarise(time.monotonic() - started, stuck, frame)
    return frame


def gather(out: Folder, workers: list[Process], stuck: Process | None) -> str:
    if not ray.is_initialized():  # Ray's calls below would start a Ray of their own
        out.failures.append("Ray: this process is not connected to a Ray cluster; nothing collected")
        return ""
    job = ray.get_runtime_context().get_job_id()
    workers = workers + [stuck] if stuck and stuck not in workers else workers
    actors = out.attempt("the GCS actor table", lambda: list(state.actors(job_id=ray.JobID.from_hex(job)).values()), [])
    dumped = workers + ray_actors(actors)
    dead = out.attempt("dead workers", lambda: dead_processes(actors, job), [])
    pending = dispatch(out, dumped, workers, dead)
    out.json(
        "cluster.json",
        out.attempt("the cluster's resources", cluster_state, {}),
        "free and total resources, per node too; placement groups still waiting (PENDING, RESCHEDULING); the nodes",
    )
    out.json(
        "dead.json",
        dead,
        f"{len(dead)} dead actor(s) and worker(s) of this job, the {MAX_DEAD} most recent at most, "
        "with their death cause",
    )
    results = collect(out, pending)
    stacks = write_results(out, results, dumped, workers)
    return top_frame(stacks.get(stuck.what, "")) if stuck else ""


def ray_actors(actors: list[dict]) -> list[Process]:
    """This job's live Ray Train controller and Ray Data split coordinators, numbered when several (one per
    dataset split between workers)."""
    found: list[Process] = []
    for actor in actors:
        kind = RAY_ACTORS.get(actor["ActorClassName"])
        if kind and actor["State"] == "ALIVE":
            count = sum(p.what.startswith(kind) for p in found)
            found.append(
                Process(
                    what=f"{kind} {count + 1}" if count else kind, node_id=actor["Address"]["NodeID"], pid=actor["Pid"]
                )
            )
    return found


def dead_processes(actors: list[dict], job: str) -> list[dict]:
    """This job's actors and workers that ended unexpectedly (a worker that crashed, one killed for memory), with
    Ray's death cause, the most recent first."""
    dead = {
        (a["Address"]["NodeID"], a["Pid"]): {
            "name": slug(
                f"{a['ActorClassName'].rsplit('.', 1)[-1]}-{a['Pid']}"
            ),  # a class's qualified name may hold <locals>
            "actor_id": a["ActorID"],
            "node_id": a["Address"]["NodeID"],
            "pid": a["Pid"],
            "ended": moment(a["EndTime"]),
            "death_cause": MessageToDict(a["DeathCause"], preserving_proto_field_name=True),
        }
        for a in actors
        if a["State"] == "DEAD" and a["DeathCause"].actor_died_error_context.reason not in DELIBERATE_ENDS
    }
    # The worker table has no public reader (ray.state.workers() lists live workers only).
    for raw in state.state._connect_and_get_accessor().get_worker_table():
        worker = gcs_pb2.WorkerTableData.FromString(raw)
        if worker.is_alive or worker.job_id.hex() != job or worker.exit_type not in UNEXPECTED_EXITS:
            continue
        entry = dead.setdefault(
            (worker.worker_address.node_id.hex(), worker.pid),
            {
                "name": f"worker-{worker.pid}",
                "node_id": worker.worker_address.node_id.hex(),
                "pid": worker.pid,
                "ended": moment(worker.end_time_ms),
            },
        )
        entry.update(exit_type=common_pb2.WorkerExitType.Name(worker.exit_type), exit_detail=worker.exit_detail)
    return sorted(dead.values(), key=lambda entry: entry["ended"], reverse=True)[:MAX_DEAD]


def moment(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds")


def cluster_state() -> dict:
    nodes = ray.nodes()
    return {
        "total": ray.cluster_resources(),
        "available": ray.available_resources(),
        "available_per_node": state.available_resources_per_node(),
        # RESCHEDULING: a group that lost a node and waits for room again, as a PENDING one does.
        "placement_groups_waiting": [
            group
            for group in ray.util.placement_group_table().values()
            if group["state"] in ("PENDING", "RESCHEDULING")
        ],
        "nodes": [
            {
                "node_id": node["NodeID"],
                "alive": node["Alive"],
                "address": node["NodeManagerAddress"],
                "resources": node["Resources"],
                "death": node.get("DeathReasonMessage", ""),
            }
            for node in nodes
        ],
    }


def dispatch(out: Folder, dumped: list[Process], workers: list[Process], dead: list[dict]) -> dict[str, ray.ObjectRef]:
    """One task per live node that holds a process of the report, all started at once: {node id: its task}."""
    alive = {node["NodeID"] for node in out.attempt("the node table", ray.nodes, []) if node["Alive"]}
    nodes = {p.node_id for p in dumped} | {d["node_id"] for d in dead}
    pending = {}
    for node in sorted(nodes):
        if node not in alive:
            out.failures.append(f"node {node}: not alive in Ray's node table; nothing collected there")
            continue
        here = [p for p in dumped if p.node_id == node]
        logs = {slug(p.what): p.pid for p in workers if p.node_id == node} | {
            d["name"]: d["pid"] for d in dead if d["node_id"] == node
        }
        pending[node] = on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            stacks={p.what: p.pid for p in here},
            environs={p.what: p.pid for p in workers if p.node_id == node},
            logs=logs,
            gpu=any(p.node_id == node for p in workers),
        )
    return pending


def collect(out: Folder, pending: dict[str, ray.ObjectRef]) -> dict[str, NodeReport]:
    """Each node's answer, waiting NODE_TIMEOUT_S at most for all; a silent node's task is ended (py-spy stuck on
    a process must not hold a worker) and the node named."""
    refs = list(pending.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=NODE_TIMEOUT_S) if refs else ([], [])
    results = {}
    for node, ref in pending.items():
        if ref not in ready:
            out.failures.append(f"node {node}: did not answer in {NODE_TIMEOUT_S:g} s")
            ray.cancel(ref, force=True)
            continue
        results[node] = out.attempt(f"node {node}", lambda ref=ref: ray.get(ref), None)
    return {node: result for node, result in results.items() if result is not None}


def write_results(
    out: Folder, results: dict[str, NodeReport], dumped: list[Process], workers: list[Process]
) -> dict[str, str]:
    """Write what the nodes sent; returns the stacks, by `what`."""
    for result in results.values():
        out.secrets |= set(result.secrets)
    stacks, environment = {}, {}
    for process in dumped:
        result = results.get(process.node_id)
        if result is None:
            continue
        if text := out.part(f"stack of {process.what}", result.stacks[process.what]):
            stacks[process.what] = text
            out.text(
                f"stacks/{slug(process.what)}.txt",
                text,
                f"py-spy dump of {process.what} (pid {process.pid}, node {process.node_id})",
            )
    for process in workers:
        if process.node_id in results:
            environment[process.what] = out.part(
                f"environment of {process.what}", results[process.node_id].environs[process.what]
            )
    out.json(
        "environment.json",
        environment,
        f"{', '.join(f'{prefix}*' for prefix in SETTINGS)} of each training worker as it "
        "started (/proc/<pid>/environ: what a process set in itself later is not there), secrets as <redacted>",
    )
    for node, result in results.items():
        if result.nvidia_smi and (text := out.part(f"nvidia-smi on node {node}", result.nvidia_smi)):
            out.text(f"nvidia-smi/{node[:12]}.txt", text, f"nvidia-smi on node {node}")
        for name, tails in result.logs.items():
            for suffix, text in (out.part(f"log of {name}", tails) or {}).items():
                out.text(
                    f"logs/{name}.{suffix}",
                    text,
                    f"the last {TAIL_LINES} lines of {name}'s worker-*.{suffix} on node {node[:12]}",
                )
    return stacks


def top_frame(dump: str) -> str:
    """The innermost frame of the thread that runs the training function in a py-spy dump: Ray Train V2 runs it
    in a thread named TrainingThread(<function>), the main thread waiting in Ray's loop meanwhile; in any other
    process the main thread. '' when the dump has neither."""
    tops: list[tuple[str, str]] = []  # (thread name, its top frame), in the dump's order
    name = None
    for line in dump.splitlines():
        if header := re.match(r'Thread \S+ \([^)]*\)(?:: "(.*)")?$', line):
            name = header[1] or ""
        elif name is not None and line.startswith("    ") and line.strip():
            tops.append((name, line.strip()))
            name = None
    training = [frame for thread, frame in tops if thread.startswith("TrainingThread(")]
    main = [frame for thread, frame in tops if thread == "MainThread"]
    return next(iter(training + main), "")


# The folder ---------------------------------------------------------------------------------------


def slug(what: str) -> str:
    """A file name for `what`: "rank 0" -> "rank-0"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", what).strip("-.") or "process"


class Folder:
    """The report's folder: every file goes through text(), which cuts the secrets known; what could not be
    collected or written is kept for README.md."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.secrets = secret_values(os.environ)
        self.written: list[tuple[str, str]] = []  # (file, what it holds)
        self.failures: list[str] = []

    def attempt(self, what: str, function: Callable[[], Any], default: Any) -> Any:
        return self.part(what, attempt(function), default)

    def part(self, what: str, part: Probed, default: Any = None) -> Any:
        """A part's value, or `default` with its failure kept."""
        if part.error is not None:
            self.failures.append(f"{what}: {part.error}")
            return default
        return part.value

    def text(self, name: str, text: str, about: str) -> None:
        for secret in sorted(self.secrets, key=len, reverse=True):  # longest first: one secret may hold another
            text = text.replace(secret, REDACTED)
        try:
            storage.write_bytes(storage.join(self.uri, name), text.encode())
            self.written.append((name, about))
        except Exception as error:  # noqa: BLE001 -- the report says what it could not write
            self.failures.append(f"{name}: not written: {type(error).__name__}: {error}")

    def json(self, name: str, payload: Any, about: str) -> None:
        # ensure_ascii=False: an escaped secret (\uXXXX) would slip past text()'s cut.
        self.text(name, json.dumps(payload, indent=2, sort_keys=True, default=str, ensure_ascii=False), about)

    def summarise(self, seconds: float, stuck: Process | None, frame: str) -> None:
        when = datetime.now(UTC).isoformat(timespec="seconds")
        lines = [f"# Stall report, {when}", "", f"Collected in {seconds:.1f} s."]
        if stuck:
            lines.append(
                f"Stuck: {stuck.what} (pid {stuck.pid}, node {stuck.node_id}); top frame: {frame or 'unknown'}"
            )
        lines += ["", "## Files", ""] + [f"- `{name}`: {about}" for name, about in self.written]
        lines += ["", "## Not collected", ""] + (
            [f"- {failure}" for failure in self.failures] or ["- nothing: every part was collected"]
        )
        self.text("README.md", "\n".join(lines) + "\n", "this summary")
        if not self.written or self.written[-1][0] != "README.md":
            log.warning("stall report: README.md not written in %s: %s", self.uri, self.failures[-1])
