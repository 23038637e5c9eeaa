"""A tiny BERT: the fast model of the test suite, the same in every session.

Its WordPiece vocabulary (tiny_tokenizer.json: 2,000 pieces of the shipped Rotten Tomatoes reviews)
was trained once and is kept as a file: the tokenizers library's trainer breaks ties between equal
counts in hash order, so a vocabulary trained afresh differed in every process, and with it what the
model learned (test accuracy 0.59-0.64 over sessions, against the suite's floor of 0.6).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertForSequenceClassification,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

VOCABULARY = Path(__file__).with_name("tiny_tokenizer.json")
# The suite's small encoder, unless a test asks for other sizes.
SIZES = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "num_labels": 2,
}


def tiny_config(model_type: str = "bert", **sizes) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **(SIZES | sizes))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(VOCABULARY)),
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


def tiny_model_files(directory: Path, model_type: str, **sizes) -> Path:
    """A model folder as the checks before any cluster work read it: a tiny config.json of model_type and
    the tiny vocabulary's tokenizer, no weights."""
    tiny_config(model_type, **sizes).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def tiny_random_model(directory: Path, model_type: str) -> Path:
    """A tiny classifier of model_type with random weights, saved with the tiny vocabulary's tokenizer."""
    tiny_model_files(directory, model_type)
    AutoModelForSequenceClassification.from_config(tiny_config(model_type)).save_pretrained(directory)
    return directory


def make_tiny_bert(directory: Path, **sizes) -> Path:
    """A BERT on the tiny vocabulary, saved with its tokenizer: the suite's model (hidden 64, 2 layers)
    unless other sizes are given."""
    tokenizer = tiny_tokenizer()
    shape = {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128} | sizes
    config = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, **shape)
    with torch.random.fork_rng():  # the same weights in every session, the session's own RNG untouched
        torch.manual_seed(0)
        BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
