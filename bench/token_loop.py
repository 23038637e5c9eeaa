"""The baseline of bench/task_kinds.py's wnut17: a plain one-process token-classification loop, as
transformers' run_ner.py trains one, without ftflow: words tokenized pre-split (truncated at max_length),
each word's first sub-token labelled, AdamW with linear warm-up and decay, the same hyperparameters as
ftflow's defaults (weight decay 0.01 on matrices, warm-up 10%, clipping at 1.0, seed 42). Prints one JSON
line: its wall seconds and its test entity F1 (seqeval, strict IOB2).

    python bench/token_loop.py <model> <train.conll> <test.conll> [--epochs 3] [--batch 16] [--lr 1e-4]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from seqeval.metrics import f1_score
from seqeval.scheme import IOB2
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)


def sentences(path: str) -> list[tuple[list[str], list[str]]]:
    found, words, tags = [], [], []
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            if words:
                found.append((words, tags))
            words, tags = [], []
            continue
        word, tag = line.rstrip("\n").split("\t")
        words.append(word)
        tags.append(tag)
    return found + ([(words, tags)] if words else [])


def encoded(tokenizer, rows, ids: dict[str, int], max_length: int) -> list[dict]:
    out = []
    for words, tags in rows:
        encoding = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
        labels, previous = [], None
        for word in encoding.word_ids():
            labels.append(-100 if word is None or word == previous else ids[tags[word]])
            previous = word
        out.append({"input_ids": encoding["input_ids"], "attention_mask": encoding["attention_mask"], "labels": labels})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("train")
    parser.add_argument("test")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(42)
    train, test = sentences(args.train), sentences(args.test)
    found = {tag for _, tags in train for tag in tags}
    names = ["O", *sorted({f"{edge}-{tag[2:]}" for tag in found - {"O"} for edge in "BI"})]
    ids = {name: i for i, name in enumerate(names)}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(names), id2label=dict(enumerate(names)), label2id=ids
    )
    collate = DataCollatorForTokenClassification(tokenizer)
    rows = encoded(tokenizer, train, ids, args.max_length)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=args.lr
    )
    steps = args.epochs * -(-len(rows) // args.batch)
    schedule = get_linear_schedule_with_warmup(optimizer, int(0.1 * steps), steps)
    model.train()
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(rows)
        for start in range(0, len(rows), args.batch):
            loss = model(**collate(rows[start : start + args.batch])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    model.eval()
    predicted, truth = [], []
    with torch.inference_mode():
        for words, tags in test:
            encoding = tokenizer(
                words, is_split_into_words=True, truncation=True, max_length=args.max_length, return_tensors="pt"
            )
            best = model(**encoding).logits[0].argmax(-1).tolist()
            first = {}
            for position, word in enumerate(encoding.word_ids()):
                if word is not None and word not in first:
                    first[word] = names[best[position]]
            predicted.append([first.get(i, "O") for i in range(len(words))])
            truth.append(tags)
    f1 = f1_score(truth, predicted, mode="strict", scheme=IOB2)
    print(json.dumps({"seconds": round(time.perf_counter() - started, 1), "entity_f1": round(f1, 4)}))


if __name__ == "__main__":
    main()
