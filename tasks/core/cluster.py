"""Connecting to Ray and sizing work to what the cluster has."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

import ray
from ray._private import ray_constants
from ray.experimental import internal_kv
from ray.util.placement_group import NODE_ID_LABEL_KEY

from tasks.core import storage
from tasks.core.strict import Device

# Tokenization's tasks ask for a quarter CPU each (tasks/tokenize/ runs at most one per CPU), so
# they never wait on CPUs that model workers hold.
READ_CPUS = 0.25
# One CPU of every cluster is left to Ray Data's own tasks: those that split the training stream
# equally between workers ask for a whole CPU and cannot be told otherwise, and once training
# workers held every CPU, training waited for its first batch forever. A local Ray therefore
# declares one CPU more than the machine has: that CPU's work (reading Parquet, shuffling token ids)
# is light beside a model's.
DATA_CPUS = 1


def machine_cpus() -> int:
    """The CPUs a Ray on this one machine declares: its cores, and DATA_CPUS more for Ray Data."""
    return (os.cpu_count() or 1) + DATA_CPUS


def jobs_api(address: str | None) -> str | None:
    """The cluster's Job API when `address` (else RAY_ADDRESS) is one: http(s)://<head>:8265, Ray's
    own convention for `ray job submit`. ftflow then runs each stage as a Ray Job (tasks/core/jobs.py)."""
    address = address or os.environ.get("RAY_ADDRESS") or ""
    return address if address.startswith(("http://", "https://")) else None


# Noted in the local Ray's key-value store by connect(), which started it: so any of its processes
# (a Tune trial's, Ray Train's controller) can tell; Ray's own dashboard address reads the same in a
# worker process whether a dashboard runs or not.
LOCAL_RAY, NAMESPACE = b"local-ray", b"ftflow"


def local_ray() -> bool:
    """The local Ray ftflow starts: one machine, no dashboard (so no state API), no node to lose to a
    preemption, and a reaper that ends it with its driver. A driver knows it by its lack of a dashboard
    address, a worker process (a Tune trial's) by connect()'s note."""
    return (
        not ray._private.worker.get_dashboard_url()
        or internal_kv._internal_kv_get(LOCAL_RAY, namespace=NAMESPACE) is not None
    )


def connect(address: str | None = None) -> None:
    """Join `address`, else RAY_ADDRESS, else start a local Ray in this process. Ray's ports listen
    on every interface, even a laptop's, so a local Ray keeps Ray's default token authentication
    (its token in ~/.ray/auth_token); a cluster's token comes from the environment
    (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), never from a parameter."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith("ray://"):
        # Tried (Ray 2.60): through Ray Client, Ray Data's executor fails at once ("'Worker' object
        # has no attribute 'core_worker'"), and the autoscaler's status in GCS is out of reach.
        raise ValueError(
            f"ray_address {address}: Ray Client cannot run ftflow's stages (Ray Data needs a driver on the "
            "cluster); give the cluster's Job API instead, http://<head>:8265, and each stage runs there as a Ray Job"
        )
    if ray.is_initialized():
        return
    if not address:
        # Ray's notice that it turned token authentication on ends "Set RAY_AUTH_MODE=disabled to opt
        # out": advice ftflow does not want a person to take.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        # "local": a plain ray.init() joins the last `ray start` cluster on this machine, and hangs
        # when that one has stopped (its address file outlives it).
        ray.init(
            address="local",
            num_cpus=machine_cpus(),
            include_dashboard=False,
            configure_logging=False,
        )
        internal_kv._internal_kv_put(LOCAL_RAY, b"1", namespace=NAMESPACE)
        return
    try:
        ray.init(address=address)
    except ConnectionError as error:  # Ray's own says "failed to connect", its cause says why
        if "token is missing or incorrect" not in str(error.__cause__):
            raise
        raise ConnectionError(
            f"the Ray cluster at {address} refused this driver's token (or its lack of one): set "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token"
        ) from None


def refuse_local_paths(paths: dict[str, list[str]], shared: bool, address: str | None) -> None:
    """Local paths ({what: paths}, e.g. the storage root, the data) on a cluster whose nodes do not all
    share this machine's disk, or that an autoscaler may add nodes to, or that runs the stages as Ray
    Jobs (always elsewhere): each node would read and write its own disk. Unless they are declared
    shared (NFS at the same path), say to use object storage; before any work. Joins the cluster to
    look, unless it is reached through its Job API."""
    local = [f"{what} {path}" for what, given in paths.items() for path in given if not storage.is_remote(path)]
    if shared or not local:
        return
    if api := jobs_api(address):
        where = f"the stages run as Ray Jobs on the cluster at {api}, whose nodes"
    else:
        connect(address)
        here = ray.util.get_node_ip_address()
        nodes = [node for node in ray.nodes() if node["Alive"]]
        grows = autoscaled()
        if not grows and len(nodes) == 1 and nodes[0]["NodeManagerAddress"] == here:
            return
        where = f"the Ray cluster has {len(nodes)} node(s){' and an autoscaler that adds more' if grows else ''}, which"
    raise ValueError(
        f"{local[0]} is a local path, but {where} do not all share this machine's disk: use object storage "
        "(s3://...), or set storage_shared=true if every node mounts it at the same path"
    )


def autoscaled() -> bool:
    """Whether an autoscaler with node types of its own serves the cluster, so that work it lacks room
    for now makes it add nodes. Ray has no public call for this. Its v1 autoscaler publishes a status
    in the GCS key-value store; a head started without a cluster config runs it too, read-only, with
    no report or only node types named after the nodes up ("node_<id>"). A head running v2 sets a
    flag instead (taken as growing: not seen here, the wheel cannot run v2's fake provider)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) or "{}")
    report = status.get("autoscaler_report") or {}
    node_types = {
        *report.get("active_nodes", {}),
        *(report.get("idle_nodes") or {}),
        *report.get("pending_launches", {}),
    }
    return any(not name.startswith("node_") for name in node_types) or is_autoscaler_v2(fetch_from_server=True)


def groups_on_nodes(workers: int, group: int, cpus_per_worker: float, use_gpu: bool) -> list[dict[str, str]] | None:
    """Ray label selectors, one per worker in rank order, that put every `group` consecutive workers on
    one node, the nodes that hold the most groups first: tensor-parallel ranks all-reduce inside every
    layer, and a node's links are the fastest. DeepSpeed's tensor-parallel groups are consecutive ranks,
    and Ray Train ranks its workers node by node, so a node holding whole groups holds them whole.
    None (Ray's packing alone) for groups of one, on one node, and on a cluster that grows: the nodes
    an autoscaler will add have no id to name yet."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    if group == 1 or len(nodes) == 1 or autoscaled():
        return None

    def groups_held(node: dict) -> int:
        held = node["Resources"].get("GPU", 0) if use_gpu else node["Resources"].get("CPU", 0) / cpus_per_worker
        return int(held + 1e-9) // group

    selectors: list[dict[str, str]] = []
    for node in sorted(nodes, key=groups_held, reverse=True):
        selectors += [{NODE_ID_LABEL_KEY: node["NodeID"]}] * (
            group * min(groups_held(node), (workers - len(selectors)) // group)
        )
    if len(selectors) < workers:
        device = "GPU" if use_gpu else f"{cpus_per_worker:g} CPU"
        raise ValueError(
            f"tensor_parallel_size={group}: the Ray cluster's nodes hold {len(selectors) // group} group(s) of {group} workers "
            f"of {device} each, and the run needs {workers // group}: use fewer workers or a smaller tensor_parallel_size"
        )
    return selectors


@dataclass(frozen=True)
class Resources:
    """What ftflow's stages may take of the cluster now, and whether asking for more makes it grow."""

    cpus: float
    gpus: int
    node_cpus: float = math.inf  # the most CPUs one node has: what a single task can ask for
    can_grow: bool = False

    @classmethod
    def of_cluster(cls) -> Resources:
        """The cluster's CPUs less DATA_CPUS, its GPUs, and whether an autoscaler serves it."""
        total, nodes = ray.cluster_resources(), [node for node in ray.nodes() if node["Alive"]]
        return cls(
            cpus=max(0.0, total.get("CPU", 0.0) - DATA_CPUS),
            gpus=int(total.get("GPU", 0)),
            node_cpus=max((node["Resources"].get("CPU", 0.0) for node in nodes), default=0.0),
            can_grow=autoscaled(),
        )

    def task_cpus(self) -> int:
        """CPUs for one task that uses as many as it may (evaluation): ftflow's share of the cluster,
        within one node. Asking for more than a node has waits forever."""
        return max(1, int(min(self.cpus, self.node_cpus)))

    def use_gpu(self, device: Device) -> bool:
        """auto: GPUs when the cluster has some now (an autoscaler reports no node types' maxima, so a
        GPU group scaled to zero is asked for with device=gpu)."""
        if device == "gpu" and not self.gpus and not self.can_grow:
            raise ValueError(
                "device=gpu but the Ray cluster has no GPU, and no autoscaler to add one: use device=cpu or auto"
            )
        return device == "gpu" or (device == "auto" and self.gpus > 0)

    def count(self, requested: int | None, fits: int, what: str, unit: str) -> int:
        """`requested`, else what fits now (at least one). A request beyond what fits is the cluster's
        to satisfy when it can grow (Ray waits for the nodes); otherwise it is refused now."""
        if requested is None:
            return max(1, fits)
        if requested > max(fits, 1) and not self.can_grow:
            raise ValueError(
                f"{what}={requested} but the Ray cluster fits {fits} ({unit}), and no autoscaler serves it to add nodes"
            )
        return requested

    def training_workers(self, requested: int | None, cpus_per_worker: float, use_gpu: bool) -> int:
        if use_gpu:
            return self.count(requested, self.gpus, "num_workers", f"{self.gpus} GPUs")
        return self.count(
            requested,
            int(self.cpus // cpus_per_worker),
            "num_workers",
            f"{self.cpus:g} CPUs at {cpus_per_worker:g} per worker",
        )

    def inference_actors(self, requested: int | None, use_gpu: bool) -> tuple[int, float, int]:
        """(actors, CPUs per actor, GPUs per actor): one per GPU, else one per CPU, each CPU actor
        (which reads and writes its own parts) taking its share of the CPUs, within a node (on a
        cluster yet to grow, one CPU)."""
        if use_gpu:
            return self.count(requested, self.gpus, "actors", f"{self.gpus} GPUs"), 1.0, 1
        actors = self.count(requested, int(self.cpus), "actors", f"{self.cpus:g} CPUs")
        # Within one node: a larger actor no node can hold waits forever (seen: 3.5 CPUs asked of
        # 3-CPU nodes once the autoscaler had added three).
        share = min(self.cpus / actors, self.node_cpus)
        return actors, max(1.0 if self.can_grow else 0.1, share), 0
