"""Tokenization benchmark: ftflow's tokenize stage against `datasets` in one process.

    python bench/tokenization.py [--rows 100000 1000000] [--files 16] [--max-length 128]

The corpus is bench/inference.py's: short Rotten Tomatoes reviews (repeated, each row numbered) in
`--files` JSONL files, here with each review's own label added, which ftflow's splits need. Both
sides use the same fast tokenizer (all-MiniLM-L6-v2, `ModelConfig().name_or_path`), the same
`max_length`, and write the same columns (label, input_ids) to Parquet:
  * baseline, what a user writes by hand: `datasets.Dataset.from_json(files)` ->
    `.map(tokenizer(...), batched=True)` -> `.to_parquet(...)`, one process (the tokenizer's own
    threads as it sets them), a fresh `datasets` cache per size so nothing is reused;
  * ftflow: `load_splits` (every row checked, every file hashed) then the `tokenize` task with its
    cache refreshed; the corpus is the training split, validation and test are 64 rows each.
Both are timed from the first read to the last write (ftflow's Ray cluster is started before). While
ftflow runs, the resident memory of every Ray worker is sampled. Prints a Markdown table for
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import pyarrow.dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from inference import peak_ray_worker_rss, review_texts, start_prefect, timed, write_corpus  # noqa: E402

from tasks.core import cluster  # noqa: E402
from tasks.core.config import DataConfig, ModelConfig  # noqa: E402
from tasks.core.data import load_splits  # noqa: E402
from tasks.tokenize.driver import tokenize_key  # noqa: E402
from tasks.tokenize.task import tokenize  # noqa: E402

SMALL_SPLIT_ROWS = 64


def with_datasets(files: list[Path], model: str, max_length: int, out: Path, cache: Path) -> int:
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus = datasets.Dataset.from_json([str(f) for f in files], cache_dir=str(cache))
    tokenized = corpus.map(
        lambda batch: tokenizer(
            batch["text"],
            truncation=True,
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=False,
        ),
        batched=True,
        remove_columns=["text"],
    )
    tokenized.to_parquet(str(out))
    return pyarrow.dataset.dataset(out).count_rows()


def with_ftflow(corpus: Path, small: Path, model: str, max_length: int, root: Path) -> tuple[int, float]:
    """Rows written for the corpus, and the seconds `load_splits` took of the whole."""
    checked, checks_s = timed(
        lambda: load_splits(DataConfig(train_uri=str(corpus), validation_uri=str(small), test_uri=str(small)))
    )
    key = tokenize_key(checked, model, max_length, str(root))
    uris = tokenize.with_options(refresh_cache=True)(key, checked, model)
    return pyarrow.dataset.dataset(uris["train"]).count_rows(), checks_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=ModelConfig().max_length)
    args = parser.parse_args()

    model = ModelConfig().name_or_path
    cluster.connect()
    start_prefect()
    lines = [
        "| rows | datasets rows/s | ftflow rows/s | ftflow / datasets | ftflow seconds (checks) | peak RSS per Ray worker |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small.jsonl"
        small.write_text(
            "".join(
                json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(review_texts()[:SMALL_SPLIT_ROWS])
            )
        )
        for rows in args.rows:
            corpus = Path(tmp) / f"corpus-{rows}"
            corpus.mkdir()
            files = write_corpus(rows, args.files, corpus, labels=True)
            cached = Path(tmp) / f"datasets-cache-{rows}"
            base_rows, base_s = timed(
                partial(with_datasets, files, model, args.max_length, Path(tmp) / f"datasets-{rows}.parquet", cached)
            )
            with peak_ray_worker_rss() as peak:
                (ftflow_rows, checks_s), ftflow_s = timed(
                    partial(with_ftflow, corpus, small, model, args.max_length, Path(tmp) / f"store-{rows}")
                )
            assert base_rows == ftflow_rows == rows, (base_rows, ftflow_rows, rows)
            print(
                f"RESULT {rows}: datasets {rows / base_s:.0f} rows/s, ftflow {rows / ftflow_s:.0f} rows/s", flush=True
            )
            lines.append(
                f"| {rows:,} | {rows / base_s:,.0f} | {rows / ftflow_s:,.0f} | {base_s / ftflow_s:.2f} "
                f"| {ftflow_s:.0f} s ({checks_s:.0f} s) | {peak['mib']:,.0f} MiB |"
            )
    print(
        f"\n{args.files} JSONL files, max_length {args.max_length}, {cluster.Resources.of_cluster().cpus:.0f} CPUs, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
