"""The house's floors, from the ground up: tasks/core/; tasks/contracts/ (what the stages hand each
other) and tasks/prefect_side/; the stages side by side, each reaching another only through its
package interface (`from tasks.train import trained`); flows/; deployments/; the `ftflow` command
(ftflow/), which nothing below imports. And everything that may run in a Ray worker imports no Prefect."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tasks"
# Prefect's side: the stages' Prefect tasks, what they share, and the report (Prefect tasks alone).
PREFECT_SIDE = ("prefect_side/*.py", "*/task.py", "report/*.py")


def module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported(source: str) -> set[str]:
    """The project's modules a source imports, at any depth: `from tasks.train import trained` is
    tasks.train, `from tasks.train import driver` is tasks.train.driver."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            named = {f"{node.module}.{alias.name}" for alias in node.names}
            modules |= {name for name in named if is_module(name)} or {node.module}
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return {name for name in modules if name.split(".")[0] in {"tasks", "flows", "deployments", "ftflow", "infra"}}


def allowed(importer: str, name: str) -> bool:
    """Whether the module `importer` may import the module `name`."""
    floor, *rest = importer.split(".")
    parts = name.split(".")
    if parts[0] == "ftflow":
        return floor == "ftflow"
    if parts[0] == "deployments":
        return floor in {"ftflow", "deployments"}
    if parts[0] == "flows":
        return floor in {"ftflow", "deployments", "flows"}
    if parts[0] == "infra":
        return floor in {"ftflow", "infra"}
    if parts[0] != "tasks" or len(parts) < 2:
        return True
    target = parts[1]
    own = rest[0] if floor == "tasks" and rest else None
    if target == own or target == "core":
        return True
    if own == "core":
        return False  # the ground floor stands on nothing of ftflow's
    if target == "contracts":
        return True
    if own == "contracts":
        return False
    if target == "prefect_side":
        return True  # the Prefect side's own rule is the test below
    # another stage: through its package interface; the flows and the command also through its Prefect task
    return len(parts) == 2 or (floor != "tasks" and parts[2:] == ["task"])


def crossings(path: Path, source: str) -> list[str]:
    importer = module(path)
    return [f"{importer} imports {name}" for name in sorted(imported(source)) if not allowed(importer, name)]


def sources() -> list[Path]:
    return sorted(
        path
        for folder in ("tasks", "flows", "deployments", "ftflow", "infra")
        for path in (ROOT / folder).rglob("*.py")
    )


def test_every_module_imports_only_its_floor_and_below():
    found = [line for path in sources() for line in crossings(path, path.read_text())]
    assert not found


def test_the_floors_are_held():
    """The rule refuses what it exists to refuse (a rule that cannot fail checks nothing)."""
    refused = {
        "tasks/sweep/trial.py": "from tasks.train.driver import trained",  # a stage's module, not its interface
        "tasks/core/predictor.py": "from tasks.contracts.metrics import Metrics",  # core over the contracts
        "tasks/contracts/labels.py": "from tasks.infer import worker",  # a contract over a stage
        "tasks/core/models.py": "import tasks.train",  # core over a stage
        "flows/finetune.py": "from ftflow.params import parameters",  # the command, from below
        "tasks/promote/task.py": "from deployments.definitions import deployments",
        "flows/sweep.py": "from tasks.train.driver import trained",  # a flow, past the stage's task
    }
    for path, source in refused.items():
        assert crossings(ROOT / path, source), f"{path}: {source}"
    accepted = {
        "tasks/sweep/trial.py": "from tasks.train import trained",
        "tasks/infer/worker.py": "from tasks.contracts.labels import labels_schema\nfrom tasks.core import storage",
        "flows/finetune.py": "from tasks.train.task import train\nfrom tasks.report import track",
        "ftflow/cli.py": "from deployments.definitions import deployments",
    }
    for path, source in accepted.items():
        assert not crossings(ROOT / path, source), f"{path}: {source}"


def test_every_name_a_stage_interface_gives_is_there():
    """A package interface names what it gives in __all__ (tasks/train's loads each when first used)."""
    for path in sorted(TASKS.glob("*/__init__.py")):
        package = importlib.import_module(module(path))
        for name in getattr(package, "__all__", []):
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"


def test_functions_and_modules_stay_short():
    """A function a reader takes in at once (60 lines), a module of one concern (400)."""
    long = []
    for path in sources():
        source = path.read_text()
        if len(source.splitlines()) > 400:
            long.append(f"{module(path)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long.append(f"{module(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


def test_what_runs_in_ray_workers_imports_no_prefect():
    prefect_side = {path for pattern in PREFECT_SIDE for path in TASKS.glob(pattern)}
    ray_side = sorted(module(path) for path in TASKS.rglob("*.py") if path not in prefect_side)
    assert "tasks.core.storage" in ray_side and "tasks.train.worker" in ray_side
    probe = (
        f"import sys\nfor name in {ray_side!r}:\n    __import__(name)\n    assert 'prefect' not in sys.modules, name"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
