"""Text and model pieces that training, tokenization and inference share: a model folder on this node,
the tokenizer's Rust core, and the one padding of token id rows. Imports no Prefect."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from tasks.core import storage

if TYPE_CHECKING:  # transformers is 4 s of import: the tokenizing workers need none of it
    from transformers import PreTrainedTokenizerBase


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


def truncating(tokenizer: PreTrainedTokenizerBase, max_length: int, pairs: str = "longest_first") -> Tokenizer:
    """The fast tokenizer's Rust core, set to encode as `tokenizer(texts, truncation=pairs,
    max_length=max_length)` does, without padding (`pairs`: which text of a pair loses tokens). Called
    on a whole list at once it skips the Python work transformers does per call (a third of a small
    model's inference time), and it unpickles in Ray workers without importing transformers."""
    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    core.enable_truncation(max_length, strategy=pairs, direction=tokenizer.truncation_side)
    core.no_padding()
    return core


def encoded(tokenizer: Tokenizer, texts: list[str], pairs: list[str] | None) -> tuple[list, list | None]:
    """Token ids of texts, or of pairs of texts ([CLS] a [SEP] b [SEP]) with their token type ids
    (None for single texts)."""
    encodings = tokenizer.encode_batch(list(zip(texts, pairs, strict=True)) if pairs is not None else texts)
    ids = [encoding.ids for encoding in encodings]
    return ids, [encoding.type_ids for encoding in encodings] if pairs is not None else None


def padded(rows: list, lengths: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, attention mask) of a batch of token id rows, padded to its longest row: the one
    padding of ftflow, for training batches and inference alike. Written out rather than the
    tokenizer's `pad`: 21 vs 328 µs for a batch of 16 reviews here."""
    input_ids = np.full((len(rows), lengths.max()), pad_id, dtype=np.int64)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = ids
    return input_ids, (np.arange(input_ids.shape[1]) < lengths[:, None]).astype(np.int64)
