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
    """A tiny classifier of model_type with random weights, saved with the tiny vocabulary's tokenizer (its
    embeddings as many as the tokenizer's ids)."""
    sizes = {"vocab_size": tiny_tokenizer().vocab_size, "max_position_embeddings": 512}
    tiny_model_files(directory, model_type, **sizes)
    AutoModelForSequenceClassification.from_config(tiny_config(model_type, **sizes)).save_pretrained(directory)
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


# Decoder families ftflow trains as classifiers, each tiny: two layers, grouped-query attention where
# the family has it (2 key-value heads for 4 query heads), a head of 8.
DECODER_SIZES = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
    **{
        family: {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 64,
            "max_position_embeddings": 128,
        }
        for family in ("llama", "mistral", "qwen2", "qwen3", "gemma")
    },
}


def tiny_bpe_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer as decoders have them (GPT-2's, Llama 3's, Qwen's): an end-of-sequence
    token and no pad token."""
    from tokenizers import ByteLevelBPETokenizer

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(texts, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=trained._tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        model_max_length=512,
        model_input_names=["input_ids", "attention_mask"],  # no token type ids, as GPT-2's and Llama's
    )


def tiny_decoder(directory: Path, family: str, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A tiny random sequence classifier of a decoder family, saved with the tokenizer (no pad token)."""
    special = dict.fromkeys(("bos_token_id", "eos_token_id"), tokenizer.eos_token_id)
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), num_labels=2, pad_token_id=None, **special, **DECODER_SIZES[family]
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
