"""The one owner of ftflow's storage layout (storage.py reads and writes it). Its paths are built
here only: by StorageRoot (the root's own) and RunStore (a run's).

    <root>/tokenized/<content-key>/<split>/*.parquet   shared by every run with the same content
    <root>/runs/<run_id>/train/                        Ray Train checkpoints
    <root>/runs/<run_id>/model/                        consolidated Hugging Face model folder
    <root>/runs/<run_id>/metrics.json
    <root>/runs/<run_id>/predictions/*.parquet, _SUCCESS.json written last: no marker, no result
    <root>/runs/<run_id>/report/report.md, *.png       the run report and its plots
    <root>/runs/<run_id>/manifest.json                 written last: no manifest, no result
    <root>/runs/<run_id>/logs/, stall/                 the console's log file; stall reports
    <root>/runs/<run_id>/trials/<trial_id>/train|model  a sweep's trials; tune/ its Ray Tune state; search.json its search
    <root>/models/<name>/champion                      the promoted model's URI, swapped in one conditional write
    <root>/labels/<name>/<run_id>/                     each champion's labelling (the on-promotion deployment)
    <root>/mlflow.db, mlflow-artifacts/                MLflow's default store, for a local root

Data safety: ftflow deletes only files an earlier ftflow job wrote and recorded (OutputFolder),
never a folder's content; refuses an output folder that holds files it did not write, an output
that overlaps an input (refuse_overlap), and a name that would leave its folder (safe_name).
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from tasks.core.storage import exists, filesystem, is_remote, join, normalize, read_json, write_json


class UnsafeOutput(ValueError):
    """An output ftflow refuses to write, before any work: the message names it and why."""


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_name(value: str, what: str) -> str:
    """A name that becomes one path segment (a run id, a model name): never '/', '..' or absolute,
    so that nothing ftflow writes or deletes under it can land outside its folder."""
    if not SAFE_NAME.match(value):
        raise UnsafeOutput(
            f"{what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
            f"digit (it names a folder in storage; '/' and '..' would leave it)"
        )
    return value


def _overlap(output: str, input_: str) -> str | None:
    """How output lies against input_ ('is', 'is inside', 'holds'), or None when apart."""
    out, inp = normalize(output), normalize(input_)
    if is_remote(out) != is_remote(inp):
        return None
    if out == inp:
        return "is"
    if out.startswith(inp.rstrip("/") + "/"):
        return "is inside"
    if inp.startswith(out.rstrip("/") + "/"):
        return "holds"
    return None


def refuse_overlap(outputs: list[str], inputs: list[str]) -> None:
    """ftflow never writes where it reads: an output equal to, inside, or holding an input is refused."""
    for output in outputs:
        for input_ in inputs:
            if how := _overlap(output, input_):
                raise UnsafeOutput(
                    f"output {normalize(output)} {how} the input {normalize(input_)}: ftflow never writes "
                    f"where it reads; choose an output location apart from every input"
                )


# Written last into an output folder (tokenized shards, predictions), so a reader can tell a complete
# result from the remains of a failed or interrupted job; Parquet readers skip "_" files.
MARKER = "_SUCCESS.json"
# Written first, removed once MARKER is there: a job is writing here (or was stopped), and its files
# are the ones whose names start with its job id. With MARKER's file list, the record of every file
# ftflow may delete in the folder.
CLAIM = "_WRITING.json"


@dataclass(frozen=True)
class OutputFolder:
    """A folder ftflow writes one whole result into, file by file on the record. A job starts only
    in a folder that is empty or holds nothing but an earlier ftflow job's recorded files; it removes
    exactly those (the marker first) and nothing else, so a user's file in the folder is never
    touched: the folder is refused instead, naming the file."""

    uri: str

    def files(self) -> set[str]:
        """Every file under the folder, as paths relative to it."""
        fs, path = filesystem(self.uri)
        fs.invalidate_cache(path)  # s3fs caches listings, and Ray workers wrote here since
        return {os.path.relpath(found, path) for found in fs.find(path)} if fs.exists(path) else set()

    def _owned(self, present: set[str]) -> set[str]:
        """The files present that ftflow's jobs recorded: the marker's list, a claiming job's earlier
        list and its job-named files, the two records themselves and their write-aside copies."""
        records = {name: read_json(join(self.uri, name)) for name in (MARKER, CLAIM) if name in present}
        listed = set(records.get(MARKER, {}).get("files", [])) | set(records.get(CLAIM, {}).get("replacing", []))
        job = records.get(CLAIM, {}).get("job")
        return {
            f
            for f in present
            if f in listed
            or f in (MARKER, CLAIM)
            or (job and Path(f).name.startswith(f"{job}_"))
            or any(Path(f).name.startswith(f".{record}.") for record in (MARKER, CLAIM))
        }

    def check(self) -> set[str]:
        """Refuse a folder holding a file ftflow did not record; else the files it did record."""
        fs, path = filesystem(self.uri)
        if fs.isfile(path):
            raise UnsafeOutput(f"output {normalize(self.uri)} is a file: name a folder for ftflow to write into")
        present = self.files()
        owned = self._owned(present)
        foreign = sorted(present - owned)
        if foreign:
            raise UnsafeOutput(
                f"output {normalize(self.uri)} holds {join(normalize(self.uri), foreign[0])}"
                f"{f' and {len(foreign) - 1} more file(s)' if len(foreign) > 1 else ''}, which ftflow did "
                "not write: ftflow writes only into an empty folder or over its own earlier output; "
                "choose another output location"
            )
        return owned

    def start(self) -> str:
        """Claim the folder for a new job and remove the earlier job's files (the marker first, so no
        reader sees it beside a half-removed result). Checked again here, at the last moment: a file
        put in the folder since the caller's check is refused too. Returns the job id that must
        start the name of every file the job writes here (f"{job}_...")."""
        owned = self.check()
        earlier = sorted(owned - {MARKER, CLAIM})
        job = uuid.uuid4().hex[:16]
        write_json(join(self.uri, CLAIM), {"job": job, "replacing": earlier})
        for name in ([MARKER] if MARKER in owned else []) + earlier:
            self._remove(name)
        return job

    def written(self, job: str) -> list[str]:
        """The files job wrote here so far, relative to the folder."""
        return sorted(f for f in self.files() if Path(f).name.startswith(f"{job}_"))

    def complete(self, job: str, written: list[str], summary: dict) -> None:
        """Record the job's files in the marker (written last, so it says the result is whole), then
        drop the claim. A job whose claim another job took over (two writers at once, which the
        deployments' concurrency limits prevent) fails rather than vouch for a mixed folder."""
        claim = join(self.uri, CLAIM)
        if not exists(claim) or read_json(claim)["job"] != job:
            raise RuntimeError(
                f"{normalize(self.uri)}: another job took this folder over while job {job} wrote; run again"
            )
        write_json(join(self.uri, MARKER), {**summary, "files": written})
        self._remove(CLAIM)

    def _remove(self, name: str) -> None:
        """The one delete in ftflow: a single file of this folder, by its recorded name."""
        fs, path = filesystem(join(self.uri, name))
        fs.rm_file(path)


@dataclass(frozen=True)
class StorageRoot:
    """The paths directly under a storage root, shared by its runs."""

    root: str

    @property
    def base(self) -> str:
        return normalize(self.root)

    def tokenized(self, content_key: str) -> str:
        return join(self.base, "tokenized", content_key)

    def champion(self, model_name: str) -> str:
        return join(self.base, "models", safe_name(model_name, "model name"), "champion")

    def labels(self, model_name: str, run_id: str) -> str:
        return join(self.base, "labels", safe_name(model_name, "model name"), safe_name(run_id, "run_id"))

    @property
    def mlflow_db(self) -> str:
        return join(self.base, "mlflow.db")

    @property
    def mlflow_artifacts(self) -> str:
        return join(self.base, "mlflow-artifacts")


@dataclass(frozen=True)
class RunStore:
    root: str
    run_id: str
    folder: str = "runs"  # of the root; a sweep's trials are run folders in its "trials" (trial)

    # Everything ftflow writes in a run's folder: a folder holding anything else is not ftflow's.
    LAYOUT = frozenset(
        {
            "train",
            "model",
            "adapter",
            "metrics.json",
            "predictions",
            "report",
            "manifest.json",
            "logs",
            "stall",
            "trials",
            "tune",
            "search.json",
        }
    )

    def __post_init__(self) -> None:
        safe_name(self.run_id, "run_id")

    def check(self) -> None:
        """Refuse, before any work, a run folder that holds what ftflow did not write (a re-run with the
        same run_id resumes in its own folder; a folder of someone else's stays untouched)."""
        fs, path = filesystem(self.base)
        names = {Path(found).name for found in fs.ls(path, detail=False)} if fs.isdir(path) else set()
        foreign = sorted(names - self.LAYOUT)
        if foreign:
            raise UnsafeOutput(
                f"run folder {self.base} holds {join(self.base, foreign[0])}, which ftflow did not write: "
                "choose another run_id"
            )
        OutputFolder(self.predictions).check()

    @classmethod
    def at(cls, run_dir: str) -> RunStore:
        """The store of the run folder <root>/runs/<run_id>."""
        root, runs, run_id = normalize(run_dir).rsplit("/", 2)
        if runs != "runs":
            raise ValueError(f"{run_dir} is not a run folder (<root>/runs/<run_id>)")
        return cls(root, run_id)

    @property
    def base(self) -> str:
        return join(normalize(self.root), self.folder, self.run_id)

    def trial(self, trial_id: str) -> RunStore:
        """A sweep trial's training folders (train/, model/, stall/), inside the sweep's run folder."""
        return RunStore(self.base, trial_id, "trials")

    @property
    def tune(self) -> str:
        """A sweep's Ray Tune experiment state: what a re-run of the sweep restores."""
        return join(self.base, "tune")

    @property
    def search(self) -> str:
        """The search a sweep's id stands for (its sweep.* and train.* fields): a re-run must give the same."""
        return join(self.base, "search.json")

    @property
    def train_dir(self) -> str:
        return join(self.base, "train")

    @property
    def model_dir(self) -> str:
        return join(self.base, "model")

    @property
    def adapter_dir(self) -> str:
        """A LoRA run's adapter alone (peft's folder), beside the merged model."""
        return join(self.base, "adapter")

    @property
    def metrics(self) -> str:
        return join(self.base, "metrics.json")

    @property
    def predictions(self) -> str:
        return join(self.base, "predictions")

    @property
    def report(self) -> str:
        return join(self.base, "report")

    @property
    def report_md(self) -> str:
        return join(self.report, "report.md")

    @property
    def logs(self) -> str:
        return join(self.base, "logs")

    @property
    def stall(self) -> str:
        return join(self.base, "stall")

    @property
    def manifest(self) -> str:
        return join(self.base, "manifest.json")
