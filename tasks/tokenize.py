"""Stage 1: tokenize the splits in parallel with Ray Data into Parquet shards in storage.

Shards live under a content-addressed prefix and the Prefect cache key is the same content key
(data hashes, how the files are read, tokenizer hash, max length, storage root): renaming or
moving the input files, or a new run id, reuses the shards; any change in what would be computed
recomputes them. The prefix is complete only once its MARKER is there, written last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.dataset
import ray
from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS
from pydantic import BaseModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks import cluster, storage
from tasks.data import Schema, Split, labelled_frames

SPLITS = ("train", "validation", "test")
MARKER = "_SUCCESS.json"  # rows per split; Parquet readers skip "_" files
BLOCK_BYTES = 16 << 20  # Ray Data block size: a large file becomes many blocks, tokenized in parallel
ENCODE_BATCH_ROWS = 1_000  # texts per tokenizer call


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
        return storage.join(self.root, "tokenized", self.digest)

    def shards_exist(self) -> bool:
        """False when the shards a cached result points to are gone or were never completed (an
        interrupted run leaves shards without the marker): then tokenize again."""
        return storage.exists(storage.join(self.target, MARKER))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not tokenizer.is_fast:
        raise ValueError(f"{name_or_path}: ftflow needs a fast (Rust) tokenizer")
    return tokenizer


def tokenize_key(splits: dict[str, Split], tokenizer: PreTrainedTokenizerBase, max_length: int, root: str) -> TokenizeKey:
    vocab = json.dumps([tokenizer.backend_tokenizer.to_str(), tokenizer.model_max_length], sort_keys=True)
    return TokenizeKey(
        data_sha256={name: split.sha256 for name, split in splits.items()},
        reading=dataclasses.asdict(splits["train"].schema),
        tokenizer_sha256=hashlib.sha256(vocab.encode()).hexdigest(),
        max_length=max_length,
        root=storage.normalize(root),
    )


def read_rows(schema: Schema) -> Callable[[pd.DataFrame], Iterator[pd.DataFrame]]:
    """A Ray Data UDF: (file URI, its first global row) in, its rows out as (row, text, label), streamed."""

    def read(batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        for uri, first_row in zip(batch["uri"], batch["first_row"]):
            for frame in labelled_frames(uri, schema):
                yield pd.DataFrame({"row": first_row + frame.index, "text": frame["text"], "label": frame["label"]})

    return read


def encoder(tokenizer: PreTrainedTokenizerBase, max_length: int) -> Callable[[pa.Table], pa.Table]:
    def encode(batch: pa.Table) -> pa.Table:
        ids = tokenizer(batch["text"].to_pylist(), truncation=True, max_length=max_length)["input_ids"]
        return pa.table({"row": batch["row"], "label": batch["label"], "input_ids": pa.array(ids, pa.list_(pa.int32()))})

    return encode


def _tokenize_split(split: Split, tokenizer: PreTrainedTokenizerBase, max_length: int, uri: str) -> int:
    """One read task per file, yielding blocks of at most BLOCK_BYTES; the blocks of every file
    are then encoded side by side. Every stage takes READ_CPUS, so it runs beside busy workers."""
    files = [{"uri": file, "first_row": first} for file, first in zip(split.uris, split.first_rows)]
    # One tokenizer per CPU (READ_CPUS alone would pack four on each); a pool size of its own also
    # keeps encoding a stage apart from the reads: Ray Data fuses matching stages, and fused, a
    # large file's blocks would be encoded one after another in its read task.
    encoders = max(1, int(cluster.Resources.of_cluster().cpus))
    path, filesystem = storage.pyarrow_filesystem(uri)
    files_ds = ray.data.from_items(files, override_num_blocks=len(files))
    files_ds.context.target_max_block_size = BLOCK_BYTES  # this pipeline's own context copy
    (
        files_ds
        .map_batches(read_rows(split.schema), batch_size=1, batch_format="pandas", num_cpus=cluster.READ_CPUS)
        .map_batches(encoder(tokenizer, max_length), batch_size=ENCODE_BATCH_ROWS, batch_format="pyarrow",
                     num_cpus=cluster.READ_CPUS, compute=ray.data.TaskPoolStrategy(size=encoders))
        .write_parquet(path, filesystem=filesystem, ray_remote_args={"num_cpus": cluster.READ_CPUS})
    )
    return pyarrow.dataset.dataset(path, filesystem=filesystem, format="parquet").count_rows()


def clear(target: str) -> None:
    """Marker first, so no reader sees it beside the remains of older shards."""
    fs, path = storage.filesystem(target)
    marker = storage.join(path, MARKER)
    if fs.exists(marker):
        fs.rm(marker)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@task(cache_policy=INPUTS - "splits" - "model_name_or_path" - "ray_address", persist_result=True)
def tokenize(
    key: TokenizeKey, splits: dict[str, Split], model_name_or_path: str, ray_address: str | None = None
) -> dict[str, str]:
    """Write each split's token ids as Parquet under <root>/tokenized/<key>/; return their URIs."""
    clear(key.target)  # leftovers of an interrupted attempt must not mix with this one
    cluster.connect(ray_address)
    tokenizer = load_tokenizer(model_name_or_path)
    uris = {name: storage.join(key.target, name) for name in SPLITS}
    rows = {name: _tokenize_split(splits[name], tokenizer, key.max_length, uris[name]) for name in SPLITS}
    for name in SPLITS:
        if rows[name] != splits[name].total_rows:  # a file changed since it was checked
            raise RuntimeError(f"{name}: wrote {rows[name]} rows, but its files held {splits[name].total_rows} when checked")
    storage.write_json(storage.join(key.target, MARKER), {"rows": rows})
    get_run_logger().info("tokenized %s rows into %s", rows, key.target)
    return uris
