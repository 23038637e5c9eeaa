"""Preemption notices, answered with a checkpoint at once.

A node that is going away drains first: SIGTERM to its `ray start` (what Kubernetes sends a pod it
evicts, and what a cloud's spot reclaim comes to) marks it draining, with a deadline
(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S on the node, 30 s by default), and Ray Train's watcher tells every
worker of the run within its poll interval (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S: 1 s as
tasks/train/driver.py sets it, Ray's default 5 s). The workers
agree on the step to answer at, checkpoint there and train on; once the node is gone Ray Train starts
them again from that checkpoint, counted against max_preemption_failures (unbounded), not max_failures.
Only the steps after it are trained again.

The workers agree by an all-reduce of one flag per optimizer step, over a gloo group of their own: on
the host, so that a GPU run does not wait for its device every step. Ray's public way,
ray.train.get_preemption_info, is a round trip through a Ray actor at every call; the notice it
agrees on is the one each worker holds, read here directly (Ray Train offers no other read of it).

Once a notice is answered, a checkpoint counts only when Ray Train's controller holds every worker's report
of it (Notice.handed_over): ray.train.report returns once the report is queued in the worker, and the
controller takes it at its next poll (every 0.5 s, tasks/train/driver.py). A node that went in between took
its rank's report with it, the checkpoint was never committed, and the run went back to step 0: once in
four CI runs of the preemption test (tests/test_elastic.py), whose node goes the moment the notice is answered.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from ray.train.v2._internal.execution.context import get_train_context

HANDOVER_S = 10.0  # the longest a worker waits for the controller to take its reports (it polls every 0.5 s)


class Notice:
    """Whether a preemption notice has reached any worker, agreed by all at the same step; once. Where
    no node can be preempted (`watched` false: ftflow's local Ray), never, and at no cost per step."""

    def __init__(self, watched: bool):
        self.group = dist.new_group(backend="gloo") if watched else None
        self.flag = torch.zeros(1, device="cpu")  # gloo's: on the host, whatever the training device
        self.answered = False

    def arrived(self) -> bool:
        if self.group is None or self.answered:
            return False
        self.flag[0] = float(get_train_context().preemption_context.preemption_info is not None)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        self.answered = bool(self.flag[0])
        return self.answered

    def handed_over(self) -> None:
        """After a notice, returns once Ray Train's controller has taken every worker's reports (Ray Train's
        worker marks a report done when its poll takes it), or after HANDOVER_S; at once before any notice."""
        if not self.answered:
            return
        reports = get_train_context().get_result_queue()
        with reports.all_tasks_done:
            reports.all_tasks_done.wait_for(lambda: not reports.unfinished_tasks, timeout=HANDOVER_S)
        dist.barrier(group=self.group)


def described() -> str:
    """The notice as this worker holds it (the watcher tells the workers one after the other)."""
    info = get_train_context().preemption_context.preemption_info
    if info is None:
        return "a preemption notice"
    nodes = ", ".join(node[:8] for node in info.preempted_node_ids)
    left = f", {info.deadline_ms / 1000 - time.time():.0f} s before its deadline" if info.deadline_ms else ""
    return f"a preemption notice for node {nodes} (rank {', '.join(map(str, info.preempted_ranks))}){left}"
