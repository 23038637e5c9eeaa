"""Stage 1, the driver side (a Ray job on the cluster, no Prefect): the content key of a shard set, the
tokenizer, and the splits tokenized in parallel, a Ray task per shard (tasks/tokenize/worker.py),
into Parquet shards in storage, the marker written last."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import ray
from pydantic import BaseModel
from tokenizers import Tokenizer

from tasks.contracts.shards import TokenizedSplits
from tasks.core import cluster, jobs, layout, storage
from tasks.core.config import ModelConfig
from tasks.core.data import Split
from tasks.core.models import hub_free, model_folder, tokenizer_sha256
from tasks.core.progress import Tick, tallied
from tasks.core.text import padding, truncating, windowing
from tasks.tokenize.worker import SPLITS, Written, shards, write_shard

if TYPE_CHECKING:  # imported where a tokenizer is loaded: see tasks/core/models.py
    from transformers import PreTrainedTokenizerBase

# One Ray task per shard; the function lives in tasks/tokenize/worker.py, so the workers import no Prefect.
write = ray.remote(num_cpus=cluster.READ_CPUS)(write_shard)


class TokenizeKey(BaseModel):
    """Everything the shards depend on, and nothing else (no paths, no run ids)."""

    data_sha256: dict[str, str]
    reading: dict  # format, columns and label names: the same bytes read otherwise give other rows
    tokenizer_sha256: str
    max_length: int
    root: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    @property
    def target(self) -> str:
        return layout.StorageRoot(self.root).tokenized(self.digest)

    @property
    def shards(self) -> TokenizedSplits:
        return TokenizedSplits(**{name: storage.join(self.target, name) for name in SPLITS})

    def shards_exist(self) -> bool:
        """False when the shards a cached result points to are gone or were never completed (an
        interrupted run leaves shards without the marker): then tokenize again."""
        return storage.exists(storage.join(self.target, layout.MARKER))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The model's fast tokenizer, or what is wrong with the model in one line."""
    model_folder(name_or_path)  # a folder that is not a model's, or a hub id the hub does not resolve
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **hub_free(name_or_path))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"model.name_or_path {name_or_path}: transformers cannot load its tokenizer: {str(error).splitlines()[0]}"
        ) from None
    if not tokenizer.is_fast:
        raise ValueError(f"model.name_or_path {name_or_path}: ftflow needs a fast (Rust) tokenizer, tokenizer.json")
    return padding(tokenizer, f"model.name_or_path {name_or_path}")


def tokenize_key(splits: dict[str, Split], name_or_path: str, max_length: int, root: str) -> TokenizeKey:
    return TokenizeKey(
        data_sha256={name: split.sha256 for name, split in splits.items()},
        reading=dataclasses.asdict(splits["train"].schema),
        tokenizer_sha256=tokenizer_sha256(name_or_path),
        max_length=max_length,
        root=storage.normalize(root),
    )


def checked_key(splits: dict[str, Split], model: ModelConfig, root: str) -> TokenizeKey:
    """The shards' key. Where those shards are not written yet, the model's tokenizer is loaded as
    well, so that one ftflow cannot tokenize with is refused before any cluster work; where they are,
    it was loaded when they were written."""
    key = tokenize_key(splits, model.name_or_path, model.max_length, root)
    if not key.shards_exist():
        load_tokenizer(model.name_or_path)
    return key


def _tokenize_splits(
    splits: dict[str, Split], tokenizer: Tokenizer, targets: dict[str, str], job: str
) -> dict[str, Written]:
    """Every split's shards as Ray tasks, at most one running per CPU: the work is CPU-bound, and
    on a 2-CPU machine eight at once ran 4x slower, starting Ray workers that add no speed. READ_CPUS
    each still, so the tasks never wait on CPUs that model workers hold. Plain tasks rather than a
    Ray Data pipeline: Ray Data's executor and its first-run actors cost 1.4 s of a 5.5 s run at
    100k rows, and this work has no stream to manage (each task returns one count). The tasks tally
    their rows as they go (tasks/core/progress.py). Returns the rows and windows written per split."""
    for target in targets.values():
        fs, path = storage.filesystem(target)
        fs.makedirs(path, exist_ok=True)
    cpus = max(1, int(cluster.Resources.of_cluster().cpus))
    schema, tokenizer = ray.put(splits["train"].schema), ray.put(tokenizer)
    running, written, planned = {}, {name: Written() for name in SPLITS}, shards(splits, cpus)
    total = sum(split.total_rows for split in splits.values())

    def tick_of(tallies: list[bytes]) -> Tick:
        counts = [Written.model_validate_json(value) for value in tallies]
        finished = sum(count.done for count in counts)
        return Tick(
            stage="tokenize",
            done=sum(count.rows for count in counts),
            total=total,
            unit="rows",
            text=f"{finished}/{len(planned)} shards",
        )

    with tallied(jobs.log, tick_of, last=True) as channel:
        try:
            for shard in planned:
                if len(running) == cpus:
                    collect(running, written)
                running[write.remote(shard, schema, tokenizer, targets[shard.split], job, channel)] = shard.split
            while running:
                collect(running, written)
        except BaseException:
            # A shard failed (or the run was stopped): the others must not write on into the folder a
            # retry is about to claim, where a file finished afterwards would join the next set's rows.
            for task in running:
                ray.cancel(task, force=True)
            raise
    return written


def collect(running: dict, written: dict[str, Written]) -> None:
    """Wait for one of the running shards; add its rows and windows to its split's."""
    [done], _ = ray.wait(list(running), num_returns=1)
    split, count = running.pop(done), ray.get(done)
    written[split] = Written(rows=written[split].rows + count.rows, windows=written[split].windows + count.windows)


def tokenized_shards(key: TokenizeKey, splits: dict[str, Split], model_name_or_path: str) -> TokenizedSplits:
    """The stage's Ray work (tasks/core/jobs.py runs it where the cluster is): the shards, then the marker."""
    output = layout.OutputFolder(key.target)
    output.check()
    job = output.start()  # leftovers of an interrupted attempt must not mix with this one
    schema, tokenizer = splits["train"].schema, load_tokenizer(model_name_or_path)
    tokenizer = (
        windowing(tokenizer, key.max_length, schema.stride)
        if schema.tagged
        else truncating(tokenizer, key.max_length, schema.truncation)
    )
    written = _tokenize_splits(splits, tokenizer, dict(key.shards), job)
    rows = {name: count.rows for name, count in written.items()}
    for name in SPLITS:
        if rows[name] != splits[name].total_rows:  # a file changed since it was checked
            raise RuntimeError(
                f"{name}: wrote {rows[name]} rows, but its files held {splits[name].total_rows} when checked"
            )
    windows = {name: count.windows for name, count in written.items()}
    output.complete(job, output.written(job), {"rows": rows, "windows": windows})
    jobs.log.info("tokenized %s rows into %s", rows, key.target)
    if windows != rows:
        jobs.log.info("texts longer than model.max_length, read in windows: %s windows", windows)
    return key.shards
