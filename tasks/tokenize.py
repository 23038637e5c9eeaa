"""Stage 1: tokenize the splits in parallel with Ray Data into Parquet shards in storage.

Shards live under a content-addressed prefix and the Prefect cache key is the same content key
(data hashes, tokenizer hash, max length, storage root): renaming or moving the input files, or a
new run id, reuses the shards; any change in what would be computed recomputes them.
"""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import ray
from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS
from pydantic import BaseModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks import cluster, storage
from tasks.data import Split

SPLITS = ("train", "validation", "test")


class TokenizeKey(BaseModel):
    """Everything the shards depend on, and nothing else (no paths, no run ids)."""

    data_sha256: dict[str, str]
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
        """False when the shards a cached result points to were deleted: then tokenize again."""
        return all(storage.exists(storage.join(self.target, name)) for name in SPLITS)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not tokenizer.is_fast:
        raise ValueError(f"{name_or_path}: ftflow needs a fast (Rust) tokenizer")
    return tokenizer


def tokenize_key(splits: dict[str, Split], tokenizer: PreTrainedTokenizerBase, max_length: int, root: str) -> TokenizeKey:
    vocab = json.dumps([tokenizer.backend_tokenizer.to_str(), tokenizer.model_max_length], sort_keys=True)
    return TokenizeKey(
        data_sha256={name: split.sha256 for name, split in splits.items()},
        tokenizer_sha256=hashlib.sha256(vocab.encode()).hexdigest(),
        max_length=max_length,
        root=storage.normalize(root),
    )


def _tokenize_split(split: Split, tokenizer: PreTrainedTokenizerBase, max_length: int, uri: str) -> None:
    frame = pd.DataFrame({"row": range(len(split.texts)), "text": split.texts, "label": split.labels})

    def encode(batch: pd.DataFrame) -> pd.DataFrame:
        ids = tokenizer(batch["text"].tolist(), truncation=True, max_length=max_length)["input_ids"]
        return pd.DataFrame({"row": batch["row"], "label": batch["label"], "input_ids": ids})

    path, filesystem = storage.pyarrow_filesystem(uri)
    blocks = max(1, min(len(frame) // 1000, int(cluster.Resources.of_cluster().cpus) * 2))
    (
        ray.data.from_pandas(frame)
        .repartition(blocks)
        .map_batches(encode, batch_format="pandas", batch_size=1000, num_cpus=cluster.READ_CPUS)
        .write_parquet(path, filesystem=filesystem)
    )


@task(cache_policy=INPUTS - "splits" - "model_name_or_path" - "ray_address", persist_result=True)
def tokenize(
    key: TokenizeKey, splits: dict[str, Split], model_name_or_path: str, ray_address: str | None = None
) -> dict[str, str]:
    """Write each split's token ids as Parquet under <root>/tokenized/<key>/; return their URIs."""
    target = key.target
    fs, path = storage.filesystem(target)
    if fs.exists(path):  # leftovers of an interrupted attempt must not mix with this one
        fs.rm(path, recursive=True)
    cluster.connect(ray_address)
    tokenizer = load_tokenizer(model_name_or_path)
    uris = {name: storage.join(target, name) for name in SPLITS}
    for name in SPLITS:
        _tokenize_split(splits[name], tokenizer, key.max_length, uris[name])
    get_run_logger().info("tokenized %s into %s", {n: len(s.texts) for n, s in splits.items()}, target)
    return uris
