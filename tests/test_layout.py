"""The house's shape: the stages stand side by side over tasks/core/, each reading the others through
their contracts, and everything that may run in a Ray worker imports no Prefect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TASKS = Path(__file__).resolve().parents[1] / "tasks"
SHARED = {"core", "prefect_side"}
# Prefect's side: the stages' Prefect tasks, what they share, and the report (Prefect tasks alone).
PREFECT_SIDE = ("prefect_side/*.py", "*/task.py", "report/*.py")
# `ftflow doctor` runs training's own plan, DeepSpeed config, trainer and engine set-up, so that
# what it checks is what a run does.
BORROWED = {("doctor", "train", module) for module in ("plan", "deepspeed_config", "trainer", "engine")}
# A sweep trial trains as the train stage does: the same function; a trial stopped early has its
# workers' placement group released as training's trainer notes it.
BORROWED |= {("sweep", "train", "driver"), ("sweep", "train", "trainer")}


def module(path: Path) -> str:
    return ".".join(path.relative_to(TASKS.parent).with_suffix("").parts).removesuffix(".__init__")


def imported(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


def test_a_stage_imports_core_and_the_other_stages_contracts_only():
    crossings = []
    for path in sorted(TASKS.glob("*/*.py")):
        stage = path.parent.name
        for name in imported(path):
            parts = name.split(".")
            if parts[0] != "tasks" or len(parts) < 3 or parts[1] in SHARED | {stage}:
                continue
            if parts[2] != "contract" and (stage, parts[1], parts[2]) not in BORROWED:
                crossings.append(f"{module(path)} imports {name}")
    assert not crossings


def test_what_runs_in_ray_workers_imports_no_prefect():
    prefect_side = {path for pattern in PREFECT_SIDE for path in TASKS.glob(pattern)}
    ray_side = sorted(module(path) for path in TASKS.rglob("*.py") if path not in prefect_side)
    assert "tasks.core.storage" in ray_side and "tasks.train.worker" in ray_side
    probe = (
        f"import sys\nfor name in {ray_side!r}:\n    __import__(name)\n    assert 'prefect' not in sys.modules, name"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
