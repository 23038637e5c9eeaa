"""Text and model pieces that training, tokenization and inference share: a model folder on this node,
the tokenizer's Rust core, and the one padding of token id rows. Imports no Prefect."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Encoding, Tokenizer, pre_tokenizers

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


def padding(tokenizer: PreTrainedTokenizerBase, name: str) -> PreTrainedTokenizerBase:
    """The tokenizer with a pad token, on the right: its own, else its end-of-sequence token, as
    transformers' recipes give decoders (GPT-2, Llama, Qwen and Mistral tokenizers have none, and their
    sequence classifiers find the last real token by it: without one, a batch of more than one row
    failed). On the right, as ftflow pads: a plain transformers loop over an exported model then pads as
    it was trained (GPT-2's learned positions gave other logits, 0.13 apart, padded on the left)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{name}: its tokenizer has neither a pad token nor an end-of-sequence token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def model_inputs(config) -> tuple[str, ...]:
    """What a model reads of a batch: a pair's token type ids only where it embeds two segments (BERT's
    type_vocab_size 2). GPT-2 would look them up as tokens, Llama's forward has no use for them, RoBERTa's
    one type is 0."""
    segments = getattr(config, "type_vocab_size", 0) or 0
    return ("input_ids", "attention_mask", "token_type_ids") if segments > 1 else ("input_ids", "attention_mask")


def truncating(tokenizer: PreTrainedTokenizerBase, max_length: int, pairs: str = "longest_first") -> Tokenizer:
    """The fast tokenizer's Rust core, set to encode as `tokenizer(texts, truncation=pairs,
    max_length=max_length)` does, without padding (`pairs`: which text of a pair loses tokens). Called
    on a whole list at once it skips the Python work transformers does per call (a third of a small
    model's inference time), and it unpickles in Ray workers without importing transformers."""
    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    core.enable_truncation(max_length, strategy=pairs, direction=tokenizer.truncation_side)
    core.no_padding()
    return core


def windowing(tokenizer: PreTrainedTokenizerBase, max_length: int, stride: int) -> Tokenizer:
    """The fast tokenizer's Rust core set to read words (token_classification: pre-split, each word as
    if a space came before it, which byte-level BPE tokenizers such as RoBERTa's and GPT-2's mark in
    their tokens) in windows of max_length tokens, each sharing `stride` tokens with the one before, so
    that a text longer than the model reads is split, never cut."""
    core = truncating(tokenizer, max_length)
    core.enable_truncation(max_length, stride=stride, direction="right")
    pre = core.pre_tokenizer
    if isinstance(pre, pre_tokenizers.ByteLevel):  # transformers' add_prefix_space=True does the same
        pre.add_prefix_space = True
        core.pre_tokenizer = pre
    return core


def windows(tokenizer: Tokenizer, words: list[list[str]]) -> list[list[Encoding]]:
    """Each row's words as its windows' encodings (one where it fits)."""
    return [[encoding, *encoding.overflowing] for encoding in tokenizer.encode_batch(words, is_pretokenized=True)]


def first_subtokens(encoding: Encoding) -> list[int]:
    """Per token of a window, the word whose first sub-token it is, else -1 (special tokens, a word's
    later sub-tokens, and those of a word the window starts inside of: its offset in the word is not 0)."""
    starts, previous = [], None
    for word, (start, _) in zip(encoding.word_ids, encoding.offsets, strict=True):
        starts.append(word if word is not None and word != previous and start == 0 else -1)
        previous = word
    return starts


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
