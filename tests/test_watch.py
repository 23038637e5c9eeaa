"""The driver's stall watch on its own clock: when a silence counts as a stall; the failure relay's line
for a node lost without notice (tasks/train/watch.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from test_cluster import ROOT

from tasks.core.layout import RunStore
from tasks.core.progress import Beat
from tasks.train import watch


def test_a_stall_is_judged_by_the_recent_step_time_once_steps_flow(monkeypatch, caplog, tmp_path):
    now = [0.0]
    monkeypatch.setattr(watch.time, "monotonic", lambda: now[0])
    reports = []
    monkeypatch.setattr(
        watch.stall,
        "report",
        lambda folder, workers, stuck: reports.append((workers, stuck)) or "all_reduce (c10d.py:1)",
    )
    store = RunStore(str(tmp_path), "stalled")
    dog = watch.Watchdog(logging.getLogger("ftflow.test"), store.stall, stall_warning_s=None)

    def heard(at: float, phase: str, step: int = 0) -> None:
        now[0] = at
        dog({0: Beat(rank=0, phase=phase, step=step, node_id="n", pid=7)})

    heard(0, "loading the model")
    heard(299, "loading the model")  # before steps flow: 5 minutes of silence are allowed
    assert not reports
    for second in range(1, 11):  # then 10 steps a second
        heard(300 + second, watch.TRAINING, step=10 * second)
    heard(310 + 29, watch.TRAINING, step=100)  # 20 x 0.1 s is below the 30 s floor
    assert not reports
    with caplog.at_level(logging.WARNING):
        heard(310 + 31, watch.TRAINING, step=100)
        heard(310 + 60, watch.TRAINING, step=100)  # the same stall: reported once
    [(workers, stuck)] = reports
    assert stuck == workers[0] and (stuck.what, stuck.pid) == ("rank 0", 7)
    [line] = caplog.messages
    assert line.startswith(
        "training has shown no progress for 31 s: rank 0 is in 'training' at step 100, top frame all_reduce (c10d.py:1); "
        f"stall report: {tmp_path}/runs/stalled/stall/"
    )

    heard(400, watch.TRAINING, step=101)  # progress again; then a slower model's 5 s steps allow 100 s
    for second in range(1, 4):
        heard(400 + 5 * second, watch.TRAINING, step=101 + second)
    heard(415 + 99, watch.TRAINING, step=104)
    assert len(reports) == 1
    heard(415 + 101, watch.TRAINING, step=104)
    assert len(reports) == 2


def test_a_node_lost_without_notice_is_named_once_ray_marks_it_dead():
    """A node gone without notice fails its peers' collectives first: the failure line names a survivor's
    error, and the node is named in a second line once Ray's GCS marks it dead (a real two-node cluster,
    in a process of its own: tests/relay_on_a_lost_node.py)."""
    script = Path(__file__).with_name("relay_on_a_lost_node.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    *said, node = done.stdout.strip().splitlines()
    ours = [line for line in said if "training worker" in line]
    assert ours == [
        "training worker 1 failed at step 100 (training): RuntimeError: [gloo] Read error [127.0.0.1]:5555: "
        "Connection reset by peer; retrying from an earlier attempt's latest checkpoint, or step 0 if it left "
        "none, attempt 2 of 2",
        f"lost training worker 0's node {node[:8]} without notice (last heard at step 100): the cause of the failure above",
    ]
