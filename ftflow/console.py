"""The `ftflow` command's terminal: ftflow's own lines (each stage's start and end, what the stages
report, warnings) and a live bar per stage (without a terminal, a line of its progress every 30 s);
the rest of the process's output (Ray's workers, DeepSpeed, transformers, Prefect's engine and
server, every subprocess) goes to a log file kept beside the run (runs/<id>/logs/). Until the run
has a folder, and for good where none takes it (`ftflow doctor`, a refused or killed run), the log is
in the user's state folder (logs_folder), where a person finds it, not in a temporary one.

The process's stdout and stderr file descriptors are pointed at the log file, not only Python's
streams: Ray's and Prefect's subprocesses, C++ code and warnings print there too. The terminal is
written through a copy of the original descriptor.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskID, TextColumn
from rich.table import Column
from rich.text import Text

from tasks.core import layout, storage
from tasks.core.progress import RUN_DIR, STAGE, TICK, Tick

PREFECT_CODE = str(Path(find_spec("prefect").origin).parent)
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where a run's records go, whoever logs them
ERRORS: Console | None = None  # once output is redirected: the terminal's stderr
ESCAPE_CODE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # ANSI CSI: colours, cursor moves
# Without a terminal (a pipe, a file, a CI log) there are no bars: a stage's progress is a line, its
# first tick and then one every this many seconds. A GPU run piped to a file showed nothing for the
# whole of its training (2026-11-27).
PIPE_TICK_EVERY_S = 30.0


class Say:
    """What a command prints itself, on the terminal."""

    def __init__(self, console: Console, bars: Progress | None = None) -> None:
        self.console, self.bars, self.width = console, bars, 0

    def result(self, rows: dict[str, str]) -> None:
        if self.bars is not None:
            self.bars.stop()  # the bars stay as they ended, above the result
        self.width = max(self.width, *(len(name) + 1 for name in rows))
        for name, text in rows.items():
            self.console.print(f"{name + ':':<{self.width}} {text}", highlight=False, soft_wrap=True)


# The stage column holds its longest name whole, a sweep's "trial 4c3ce_00000": at 17 columns, rich cut
# every trial's to "trial 4c3ce_00…" on an 80-column terminal, and the trials' rows could not be told apart.
STAGE_WIDTH = len("  trial 4c3ce_00000")


class Status(ProgressColumn):
    """A bar's counts, elapsed time, ETA and the tick's own words, as one text that a narrow terminal
    cuts at its end (rich squeezes every column of its own alike, counts and ETA included)."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True, overflow="ellipsis"))

    def render(self, task) -> Text:
        of = f"/{task.total:,.0f}" if task.total is not None else ""
        left = task.time_remaining
        eta = f"  ETA {timedelta(seconds=round(left))}" if left is not None and not task.finished else ""
        return Text(
            f"{task.completed:,.0f}{of} {task.fields['unit']}  {timedelta(seconds=round(task.elapsed or 0))}{eta}  "
            f"{task.fields['words']}",
            no_wrap=True,
            overflow="ellipsis",
        )


def stage_bars(console: Console) -> Progress:
    """The live table: a row per stage (its name, its bar, Status), on a terminal only."""
    return Progress(
        TextColumn("  {task.description}", table_column=Column(no_wrap=True, min_width=STAGE_WIDTH)),
        BarColumn(bar_width=24),
        Status(),
        console=console,
        disable=not console.is_terminal,  # a pipe gets the lines only
        redirect_stdout=False,
        redirect_stderr=False,
    )  # Python's prints (Ray's workers') stay in the log


class Terminal(logging.Handler):
    """A run's records on the terminal: ticks move the stage's bar, stage records print its start and
    end, ftflow's other records print as lines; Prefect's engine's own records stay in the log file."""

    def __init__(self, console: Console, bars: Progress) -> None:
        super().__init__(logging.INFO)
        self.console, self.bars, self.run_dir = console, bars, None
        self.stage_bars: dict[str, TaskID] = {}
        self.printed_at: dict[str, float] = {}  # without a terminal: when each stage's tick was last a line

    def emit(self, record: logging.LogRecord) -> None:
        if record.pathname.startswith(PREFECT_CODE):
            return
        self.run_dir = getattr(record, RUN_DIR, self.run_dir)
        tick = getattr(record, TICK, None)
        if tick is not None and not self.bars.disable:
            self.moved(tick)
        elif tick is not None and not self.due(tick.stage):
            return  # without a terminal a tick is a line below, at most every PIPE_TICK_EVERY_S
        elif (marks := getattr(record, STAGE, None)) is not None:
            event, stage = marks
            if event == "end" and (bar := self.stage_bars.get(stage)) is not None:
                self.bars.update(
                    bar, completed=self.bars.tasks[bar].total
                )  # the last tick may come before the last step
            self.console.print(Text(f"{'▶' if event == 'start' else '✓'} {record.getMessage()}", style="bold"))
        else:
            style = {logging.WARNING: "yellow", logging.ERROR: "red"}.get(record.levelno, "dim")
            self.console.print(Text(f"  {plain(record.getMessage())}", style=style))

    def due(self, stage: str) -> bool:
        now = time.monotonic()
        if now - self.printed_at.get(stage, -math.inf) < PIPE_TICK_EVERY_S:
            return False
        self.printed_at[stage] = now
        return True

    def moved(self, tick: Tick) -> None:
        if tick.stage not in self.stage_bars:
            self.stage_bars[tick.stage] = self.bars.add_task(tick.stage, total=tick.total, unit=tick.unit, words="")
        self.bars.update(self.stage_bars[tick.stage], completed=tick.done, total=tick.total, words=tick.words())


def redirect(log_file: Path) -> Console:
    """File descriptors 1 and 2 into log_file for the rest of the process (its exit too: Ray's and
    Prefect's shutdown print); a Console on the terminal's stdout they were, and one on its stderr
    kept as ERRORS."""
    global ERRORS
    sys.stdout.flush()
    sys.stderr.flush()
    out, err = (os.fdopen(os.dup(fd), "w", buffering=1) for fd in (1, 2))
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    ERRORS = Console(file=err, highlight=False, soft_wrap=True)
    return Console(file=out, highlight=False, soft_wrap=True)


def error(text: str) -> None:
    """An error's line (or --debug's traceback) on the terminal's stderr, redirected or not."""
    (ERRORS or Console(stderr=True, highlight=False, soft_wrap=True)).print(plain(text), style="red", markup=False)


def plain(text: str) -> str:
    """text without terminal escape codes: Ray colours names in its errors' messages
    (`\x1b[36mray::MapWorker(...)\x1b[39m`), which a log, a pipe or a screen reader shows as is."""
    return ESCAPE_CODE.sub("", text)


@contextmanager
def session(verbose: bool) -> Iterator[Say]:
    """The block's output as described above (verbose: all of it on the terminal, as is). The log
    file is written in logs_folder(), then moved to the run's folder once the run has said which it
    is (a run refused before, e.g. for a folder not ftflow's, or killed, leaves it there)."""
    if verbose:
        yield Say(Console(highlight=False))
        return
    log_file = logs_folder() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    console = redirect(log_file)
    bars = stage_bars(console)
    terminal, say = Terminal(console, bars), Say(console, bars)
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(terminal)
    try:
        with bars:
            yield say
    finally:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeHandler(terminal)
        if where := kept(log_file, terminal.run_dir):
            say.result({"logs": where})


def logs_folder() -> Path:
    """The user's state folder for ftflow's logs (XDG's: $XDG_STATE_HOME, else ~/.local/state)."""
    folder = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "ftflow" / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def kept(log_file: Path, run_dir: str | None) -> str | None:
    """Where the log file ends up: copied to <run_dir>/logs/ (the first one removed: what the process
    prints on its way out goes to the removed file), or where it is; None, and no file, where nothing
    was written to it (a command refused before it started anything)."""
    if run_dir is None:
        if log_file.stat().st_size == 0:
            log_file.unlink()
            return None
        return str(log_file)
    kept_at = storage.join(layout.RunStore.at(run_dir).logs, log_file.name)
    storage.write_bytes(kept_at, log_file.read_bytes())
    log_file.unlink()
    return kept_at
