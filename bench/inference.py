"""Batch inference benchmark: ftflow's `predict_files` against a plain transformers loop.

    python bench/inference.py [--rows 10000 100000 1000000] [--model tiny|minilm|PATH] [--files 16]
                              [--precision auto|fp32|bf16] [--engine torch|compile|deepspeed] [--test-accuracy]

The corpus is short Rotten Tomatoes reviews (repeated, each row numbered) in `--files` JSONL files.
The baseline is the loop a user writes by hand: one process with all of the machine's CPUs, the
same model, batches of 64 rows in file order (no sorting), `torch.no_grad()`, fp32. Both are
timed from the first file read to the last prediction written (the baseline keeps predictions in
memory: it writes nothing); Prefect's temporary API server, which a task called outside a flow
starts once per process (~10 s here; none with a running server), is started before. While ftflow
runs, the resident memory of every Ray worker process is sampled: its peak shows what bounds
memory (window and batch size, not the corpus size). Prints a Markdown table for bench/RESULTS.md.
`--precision` and `--engine` are ftflow's `inference.precision` and `inference.engine` (the plain loop
stays fp32 and eager); `--test-accuracy`, with
a fine-tuned model folder, also prints its Rotten Tomatoes test accuracy at fp32 and at that precision.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pandas as pd
import psutil
import torch
from prefect import task

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_model import make_tiny_bert  # noqa: E402

from tasks.core import cluster  # noqa: E402
from tasks.core.config import InferenceConfig, ModelConfig  # noqa: E402
from tasks.core.files import iter_frames  # noqa: E402
from tasks.core.progress import periodically  # noqa: E402
from tasks.infer.task import predict_files  # noqa: E402

BATCH = 64


def shipped_reviews() -> list[dict]:
    """The shipped training split's rows, {"text", "label"}: the corpus every benchmark repeats."""
    return [json.loads(line) for line in (ROOT / "data/rotten_tomatoes/train.jsonl").read_text().split("\n") if line]


def write_corpus(rows: int, files: int, folder: Path, labels: bool = False) -> list[Path]:
    """`rows` reviews, repeated and each prefixed with its row number, in `files` JSONL files; with
    each review's own label when `labels` (what labelled splits need)."""
    reviews = shipped_reviews()

    def record(i: int) -> dict:
        review = reviews[i % len(reviews)]
        return {"text": f"{i}: {review['text']}"} | ({"label": review["label"]} if labels else {})

    per_file = -(-rows // files)
    paths = []
    for f in range(files):
        start, stop = f * per_file, min(rows, (f + 1) * per_file)
        path = folder / f"part-{f:04d}.jsonl"
        path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(start, stop)))
        paths.append(path)
    return paths


def plain_loop(model_path: str, files: list[Path]) -> int:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    labelled = []
    with torch.no_grad():
        for path in files:
            for frame in iter_frames(str(path)):
                texts = frame["text"].tolist()
                for i in range(0, len(texts), BATCH):
                    encoded = tokenizer(texts[i : i + BATCH], padding=True, truncation=True, return_tensors="pt")
                    labelled.extend(model(**encoded).logits.argmax(-1).tolist())
    return len(labelled)


def test_accuracy(model: str, precision: str, folder: Path) -> float:
    """The shipped test split labelled by ftflow at `precision`: the share of rows labelled as in the
    file (ids there, the model's label names in the predictions)."""
    from transformers import AutoConfig

    names = AutoConfig.from_pretrained(model).id2label
    split = ROOT / "data/rotten_tomatoes/test.jsonl"
    labels = pd.concat(iter_frames(str(split)), ignore_index=True)["label"]  # read as predict_files numbers the rows
    truth = {f"{split.name}:{i}": names[label] for i, label in enumerate(labels)}
    predict_files(model, InferenceConfig(input_uri=str(split), precision=precision), str(folder / f"test-{precision}"))
    labelled = pd.read_parquet(folder / f"test-{precision}")
    return float((labelled["label"] == labelled["id"].map(truth)).mean())


@task
def start_prefect() -> None:
    """Run once before timing: a task called outside a flow starts Prefect's temporary API server."""


@contextmanager
def peak_ray_worker_rss() -> dict:
    """{"mib": peak resident memory of any one Ray worker process}, sampled every 0.2 s."""
    peak = {"mib": 0.0}

    def sample() -> None:
        for proc in psutil.process_iter(["cmdline", "memory_info"]):
            if proc.info["cmdline"] and proc.info["cmdline"][0].startswith("ray::") and proc.info["memory_info"]:
                peak["mib"] = max(peak["mib"], proc.info["memory_info"].rss / 2**20)

    with periodically(sample, 0.2):
        yield peak


def timed(run) -> tuple[int, float]:
    started = time.perf_counter()
    rows = run()
    return rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--model", default="tiny", help="tiny (the tests' 2-layer BERT), minilm, or a model folder")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--engine", choices=["torch", "compile", "deepspeed"], default="torch")
    parser.add_argument("--test-accuracy", action="store_true", help="with a fine-tuned model folder")
    args = parser.parse_args()

    cluster.connect()
    start_prefect()
    lines = [
        "| model | rows | plain loop rows/s | ftflow rows/s | ftflow / plain | ftflow seconds | peak RSS per Ray worker |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = {"minilm": ModelConfig().name_or_path}.get(args.model, args.model)
        if model == "tiny":
            model = str(make_tiny_bert(Path(tmp) / "tiny-bert"))
        for rows in args.rows:
            corpus = Path(tmp) / f"corpus-{rows}"
            corpus.mkdir()
            files = write_corpus(rows, args.files, corpus)
            plain_rows, plain_s = timed(partial(plain_loop, model, files))
            out = str(Path(tmp) / f"out-{rows}")
            with peak_ray_worker_rss() as peak:
                config = InferenceConfig(
                    input_uri=str(corpus), batch_size=BATCH, precision=args.precision, engine=args.engine
                )
                labelled, ftflow_s = timed(partial(predict_files, model, config, out))
            ftflow_rows = labelled.rows
            assert plain_rows == ftflow_rows == rows == len(pd.read_parquet(out)), (plain_rows, ftflow_rows, rows)
            print(
                f"RESULT {args.model} {rows}: plain {rows / plain_s:.0f} rows/s, ftflow {rows / ftflow_s:.0f} rows/s",
                flush=True,
            )
            lines.append(
                f"| {args.model} | {rows:,} | {rows / plain_s:,.0f} | {rows / ftflow_s:,.0f} | {plain_s / ftflow_s:.2f} "
                f"| {ftflow_s:.0f} s | {peak['mib']:,.0f} MiB |"
            )
        if args.test_accuracy:
            accuracy = {
                precision: test_accuracy(model, precision, Path(tmp))
                for precision in dict.fromkeys(("fp32", args.precision))
            }
            print(
                "Rotten Tomatoes test accuracy: " + ", ".join(f"{p} {a:.4f}" for p, a in accuracy.items()), flush=True
            )
    print(
        f"\n{args.files} JSONL files, batch size {BATCH}, ftflow precision {args.precision}, engine {args.engine}, "
        f"{cluster.Resources.of_cluster().cpus:.0f} CPUs\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
