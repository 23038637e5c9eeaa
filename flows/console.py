"""The `ftflow` command's terminal: ftflow's own lines (each stage's start and end, what the stages
report, warnings) and a live bar per stage; the rest of the process's output (Ray's workers,
DeepSpeed, transformers, Prefect's engine and server, every subprocess) goes to a log file kept
beside the run (runs/<id>/logs/).

The process's stdout and stderr file descriptors are pointed at the log file, not only Python's
streams: Ray's and Prefect's subprocesses, C++ code and warnings print there too. The terminal is
written through a copy of the original descriptor.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tasks import storage
from tasks.progress import RUN_DIR, STAGE, TICK, Tick

PREFECT_CODE = str(Path(find_spec("prefect").origin).parent)
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where a run's records go, whoever logs them
TERMINAL: Console | None = None  # once output is redirected: the terminal


class Say:
    """What a command prints itself, on the terminal."""

    def __init__(self, console: Console) -> None:
        self.console, self.width = console, 0

    def result(self, rows: dict[str, str]) -> None:
        self.width = max(self.width, *(len(name) + 1 for name in rows))
        for name, text in rows.items():
            self.console.print(f"{name + ':':<{self.width}} {text}", highlight=False, soft_wrap=True)


class Terminal(logging.Handler):
    """A run's records on the terminal: ticks move the stage's bar, stage records print its start and
    end, ftflow's other records print as lines; Prefect's engine's own records stay in the log file."""

    def __init__(self, console: Console, bars: Progress) -> None:
        super().__init__(logging.INFO)
        self.console, self.bars, self.run_dir = console, bars, None
        self.stage_bars: dict[str, TaskID] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.pathname.startswith(PREFECT_CODE):
            return
        self.run_dir = getattr(record, RUN_DIR, self.run_dir)
        if (tick := getattr(record, TICK, None)) is not None:
            self.moved(tick)
        elif (marks := getattr(record, STAGE, None)) is not None:
            event, stage = marks
            if event == "end" and (bar := self.stage_bars.get(stage)) is not None:
                self.bars.update(bar, completed=self.bars.tasks[bar].total)  # the last tick may come before the last step
            self.console.print(f"[bold]{'▶' if event == 'start' else '✓'} {record.getMessage()}[/]", highlight=False)
        else:
            style = {logging.WARNING: "yellow", logging.ERROR: "red"}.get(record.levelno, "dim")
            self.console.print(f"  [{style}]{record.getMessage()}[/]", highlight=False, soft_wrap=True, markup=True)

    def moved(self, tick: Tick) -> None:
        if tick.stage not in self.stage_bars:
            self.stage_bars[tick.stage] = self.bars.add_task(tick.stage, total=tick.total, unit=tick.unit, words="")
        words = tick.line().split(f" {tick.unit}", 1)[-1].lstrip(", ")
        self.bars.update(self.stage_bars[tick.stage], completed=tick.done, total=tick.total, words=words)


def redirect(log_file: Path) -> Console:
    """File descriptors 1 and 2 into log_file for the rest of the process (its exit too: Ray's and
    Prefect's shutdown print); a Console on the terminal they were, also kept as TERMINAL."""
    global TERMINAL
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    TERMINAL = Console(file=terminal, highlight=False, soft_wrap=True)
    return TERMINAL


def error(text: str) -> None:
    """An error's line (or --debug's traceback) on the terminal, redirected or not."""
    (TERMINAL or Console(stderr=True, highlight=False, soft_wrap=True)).print(text, style="red", markup=False)


@contextmanager
def session(verbose: bool) -> Iterator[Say]:
    """The block's output as described above (verbose: all of it on the terminal, as is). The log
    file is written in a temporary folder, then kept in the run's folder once the run has said which
    it is (a run refused before, e.g. for a folder not ftflow's, leaves it in the temporary one)."""
    if verbose:
        yield Say(Console(highlight=False))
        return
    log_file = Path(tempfile.mkdtemp(prefix="ftflow-")) / f"{time.strftime('%Y%m%d-%H%M%S')}.log"
    console = redirect(log_file)
    bars = Progress(TextColumn("  {task.description:<15}"), BarColumn(bar_width=28), MofNCompleteColumn(),
                    TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    TextColumn("{task.fields[words]}"), console=console, disable=not console.is_terminal)  # a pipe gets lines only
    terminal, say = Terminal(console, bars), Say(console)
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(terminal)
    try:
        with bars:
            yield say
    finally:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeHandler(terminal)
        say.result({"logs": kept(log_file, terminal.run_dir)})


def kept(log_file: Path, run_dir: str | None) -> str:
    """Where the log file ends up: copied to <run_dir>/logs/ (the temporary one removed: what the
    process prints on its way out goes to the removed file), or where it is."""
    if run_dir is None:
        return str(log_file)
    kept_at = storage.join(run_dir, "logs", log_file.name)
    storage.write_bytes(kept_at, log_file.read_bytes())
    log_file.unlink()
    log_file.parent.rmdir()
    return kept_at
