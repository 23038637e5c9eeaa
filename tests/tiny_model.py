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
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

VOCABULARY = Path(__file__).with_name("tiny_tokenizer.json")


def make_tiny_bert(directory: Path) -> Path:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(VOCABULARY)),
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        num_labels=2,
    )
    with torch.random.fork_rng():  # the same weights in every session, the session's own RNG untouched
        torch.manual_seed(0)
        BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
