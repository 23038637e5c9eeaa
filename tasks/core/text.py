"""Text and model pieces that training, tokenization and inference share: a model folder on this node,
the tokenizer's Rust core, and the one padding of token id rows. Imports no Prefect."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from tasks.core import storage


@contextmanager
def local_model(model_uri: str) -> Iterator[str]:
    """A local folder holding the model while the block loads it: the path itself, or a download of a
    remote one, removed after the block (each process that loaded a model from S3 left its copy in
    /tmp)."""
    if not storage.is_remote(model_uri):
        yield model_uri
        return
    with tempfile.TemporaryDirectory(prefix="ftflow-model-") as folder:
        yield str(storage.download_dir(model_uri, folder))


def truncating(tokenizer: PreTrainedTokenizerBase, max_length: int) -> Tokenizer:
    """The fast tokenizer's Rust core, set to encode as `tokenizer(texts, truncation=True,
    max_length=max_length)` does, without padding. Called on a whole list at once it skips the
    Python work transformers does per call (a third of a small model's inference time), and it
    unpickles in Ray workers without importing transformers."""
    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    core.enable_truncation(max_length, direction=tokenizer.truncation_side)
    core.no_padding()
    return core


def padded(rows: list, lengths: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, attention mask) of a batch of token id rows, padded to its longest row: the one
    padding of ftflow, for training batches and inference alike. Written out rather than the
    tokenizer's `pad`: 21 vs 328 µs for a batch of 16 reviews here."""
    input_ids = np.full((len(rows), lengths.max()), pad_id, dtype=np.int64)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = ids
    return input_ids, (np.arange(input_ids.shape[1]) < lengths[:, None]).astype(np.int64)
