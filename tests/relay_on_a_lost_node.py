"""Run by test_watch in a process of its own (the suite's Ray is another cluster): a training group's
failure relayed on Ray Train's controller as FailureRelay does it, as a node of the group goes without
notice, on a real two-node Ray cluster (ray.cluster_utils) whose GCS marks a silent node dead in ~2 s.
Prints the run's log lines, once the lost node is named or after WAIT_S, then the lost node's id."""

from __future__ import annotations

import logging
import sys
import time

import ray
from ray.cluster_utils import Cluster

from tasks.core.progress import Beat, beat, relayed
from tasks.train.watch import FailureRelay

# A node's health checks start 5 s after it joined by default (health_check_initial_delay_ms): the node
# lost here 0.1 s after joining was marked dead 5 s later, not 1.5 s.
QUICK_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
}
WAIT_S = 30


class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


if __name__ == "__main__":
    run, said = logging.getLogger("run"), Said()
    run.addHandler(said)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": QUICK_HEALTH_CHECKS})
    lost = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    with relayed(run) as channel:
        here = ray.get_runtime_context().get_node_id()
        beat(channel, Beat(rank=0, phase="training", step=100, node_id=lost.node_id, pid=1))
        beat(channel, Beat(rank=1, phase="training", step=100, node_id=here, pid=2))
        # what the surviving worker raised: its collective's peer had gone
        survivor = RuntimeError("[gloo] Read error [127.0.0.1]:5555: Connection reset by peer")
        FailureRelay(channel, max_failures=1).after_exception(None, {1: survivor})
        cluster.remove_node(lost, allow_graceful=False)
        deadline = time.monotonic() + WAIT_S
        while not any(line.startswith("lost") for line in said.lines) and time.monotonic() < deadline:
            time.sleep(0.2)
    ray.shutdown()
    cluster.shutdown()  # at once: left to the interpreter's exit, the cluster's processes took ~8 s to end
    print(*said.lines, lost.node_id, sep="\n")  # after Ray's own lines on stdout, which shutdown prints
    sys.stdout.flush()
