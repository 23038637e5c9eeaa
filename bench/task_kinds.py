"""The other tasks on real data (issue 44), each an `ftflow run` of the shipped MiniLM on this machine:

    goemotions  multi-label, 27 emotions (neutral = no label): micro and macro F1 on its test split,
                beside the GoEmotions paper's BERT-base macro F1 of 0.46 (28 classes with neutral; a
                larger model, so not a target);
    emobank     regression of valence: Pearson's r on its test split, target at least 0.60;
    pairs       throughput of pairs against single texts of the same total length: tokenization
                and batch inference rows/s, target within 10% (a pair: a review and the next one;
                a single text: the two joined by a space);
    wnut17      token classification, WNUT-17's named entities as published (CoNLL, its whole
                training split, 3 epochs at 1e-4, batch 16): test entity F1, target at least 0.44; the
                whole job against a plain one-process loop doing the same (bench/token_loop.py),
                target at most 1.3x; batch inference of the test texts (raw text, entities out)
                against a single-label model of the same encoder on the same texts, target within 15%.

Each run trains on a seeded subset of at most ROWS training rows where the data has more (stated in
the output), evaluating at epoch ends only, so that it ends within 15 minutes here.

    python bench/task_kinds.py [goemotions] [emobank] [pairs] [wnut17] [--rows 12000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from end_to_end import FTFLOW, environment

from tasks.core.model_config import default_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PAPER_MACRO_F1 = 0.46
VALENCE_PEARSON = 0.60


def subset(source: Path, rows: int, folder: Path) -> str:
    """A seeded subset of a JSONL or CSV file's rows (its header kept), or the file itself."""
    lines = source.read_text().strip().split("\n")  # not splitlines: texts hold U+2028
    header, body = (lines[:1], lines[1:]) if source.suffix == ".csv" else ([], lines)
    if len(body) <= rows:
        return str(source)
    random.Random(0).shuffle(body)
    path = folder / f"{source.stem}-{rows}{source.suffix}"
    path.write_text("\n".join(header + body[:rows]) + "\n")
    return str(path)


def ftflow(params: dict, folder: Path, name: str) -> tuple[dict, float]:
    """`ftflow run` on params: its manifest and wall seconds."""
    file = folder / f"{name}.json"
    file.write_text(json.dumps(params | {"storage_root": str(folder / "store"), "run_id": name}))
    started = time.perf_counter()
    done = subprocess.run([*FTFLOW, "run", "--params", str(file)], env=environment(), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((folder / "store" / "runs" / name / "manifest.json").read_text()), wall


def goemotions(folder: Path, rows: int, epochs: int) -> None:
    source = DATA / "goemotions"
    names = (source / "labels.txt").read_text().split()
    data = {
        "task": "multi_label",
        "label_column": "labels",
        "label_names": names,
        "train_uri": subset(source / "train.jsonl", rows, folder),
        "validation_uri": str(source / "validation.jsonl"),
        "test_uri": str(source / "test.jsonl"),
    }
    manifest, wall = ftflow({"data": data, "train": {"epochs": epochs, "eval_every_steps": 0}}, folder, "goemotions")
    test = manifest["metrics"]["test"]
    print(
        f"| GoEmotions | {manifest['data']['splits']['train']['rows']} | {epochs} | {wall:.0f} | micro F1 "
        f"{test['micro_f1']:.4f}, macro F1 {test['macro_f1']:.4f}, subset accuracy {test['subset_accuracy']:.4f} "
        f"| the paper's BERT-base macro F1 {PAPER_MACRO_F1} (28 classes, neutral one of them) |"
    )
    best = sorted(test["labels"], key=lambda label: -label["f1"])
    print("labels by test F1:", ", ".join(f"{label['name']} {label['f1']:.2f}" for label in best))


def emobank(folder: Path, rows: int, epochs: int) -> None:
    source = DATA / "emobank"
    data = {
        "task": "regression",
        "format": "csv",
        "label_column": "valence",
        "train_uri": subset(source / "train.csv", rows, folder),
        "validation_uri": str(source / "validation.csv"),
        "test_uri": str(source / "test.csv"),
    }
    manifest, wall = ftflow({"data": data, "train": {"epochs": epochs, "eval_every_steps": 0}}, folder, "emobank")
    test = manifest["metrics"]["test"]
    verdict = "met" if test["pearson"] >= VALENCE_PEARSON else "NOT met"
    print(
        f"| EmoBank valence | {manifest['data']['splits']['train']['rows']} | {epochs} | {wall:.0f} | Pearson "
        f"{test['pearson']:.4f}, Spearman {test['spearman']:.4f}, MSE {test['mse']:.4f}, MAE {test['mae']:.4f} | "
        f"Pearson >= {VALENCE_PEARSON}: {verdict} |"
    )


def pairs(folder: Path, rows: int, epochs: int) -> None:
    """Tokenization and batch inference of pairs against single texts of the same words."""
    lines = (DATA / "rotten_tomatoes" / "train.jsonl").read_text().strip().split("\n")  # texts hold U+2028
    reviews = [json.loads(line) for line in lines]
    random.Random(0).shuffle(reviews)
    reviews = reviews[: min(rows, len(reviews))]
    paired = [
        {"text": row["text"], "next": reviews[(i + 1) % len(reviews)]["text"], "label": row["label"]}
        for i, row in enumerate(reviews)
    ]
    joined = [{"text": f"{row['text']} {row['next']}", "label": row["label"]} for row in paired]
    for name, rows_of, extra in (("single", joined, {}), ("pairs", paired, {"text_pair_column": "next"})):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows_of))
        data = {"train_uri": str(path), "validation_uri": str(path), "test_uri": str(path)} | extra
        train = {"max_steps": 1, "eval_every_steps": 0}
        manifest, _ = ftflow({"data": data, "model": {"max_length": 256}, "train": train}, folder, name)
        tokenized = 3 * len(rows_of) / manifest["seconds"]["tokenize"]  # the three splits, one file each
        pair = ["--text-pair-column", "next"] if extra else []
        model, out = manifest["outputs"]["model"], str(folder / f"{name}-labels")
        done = subprocess.run(
            [*FTFLOW, "infer", model, str(path), out, *pair], env=environment(), capture_output=True, text=True
        )
        if done.returncode:
            sys.exit(f"{name} inference failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        labelled = next(line for line in done.stdout.splitlines() if line.startswith("rows/s:")).split()[-1]
        print(f"| {name} | {len(rows_of)} | tokenize {tokenized:,.0f} rows/s | batch inference {labelled} rows/s |")


WNUT_F1, WNUT_LOOP_RATIO, WNUT_INFERENCE_RATIO = 0.44, 1.3, 0.85
WNUT_EPOCHS = 3  # the plain loop: 3 epochs at 1e-4, batch 16, first sub-tokens, strict entities


def wnut17(folder: Path, rows: int, epochs: int) -> None:
    """ftflow's token classifier on WNUT-17 beside the plain loop, then its inference beside a single-label model's."""
    source = DATA / "wnut17"
    files = {"train": "wnut17train.conll", "validation": "emerging.dev.conll", "test": "emerging.test.annotated"}
    data = {"task": "token_classification", "format": "conll"} | {f"{k}_uri": str(source / v) for k, v in files.items()}
    train = {"epochs": WNUT_EPOCHS, "batch_size": 16, "learning_rate": 1e-4, "eval_every_steps": 0}
    manifest, wall = ftflow({"data": data, "train": train, "promotion": {"model_name": "wnut17"}}, folder, "wnut17")
    model = manifest["outputs"]["model"]
    loop_args = [str(source / files["train"]), str(source / files["test"]), "--epochs", str(WNUT_EPOCHS)]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("token_loop.py")), default_model(), *loop_args],
        env=environment(),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"the plain loop failed:\n{done.stderr[-3000:]}")
    loop = json.loads(done.stdout.strip().splitlines()[-1])
    f1 = manifest["metrics"]["test"]["entity_f1"]
    print(
        f"| wnut17 (ftflow) | {manifest['data']['splits']['train']['rows']} | {WNUT_EPOCHS} | {wall:.0f} | "
        f"entity F1 {f1:.4f} | target >= {WNUT_F1} |"
    )
    print(
        f"| wnut17 (plain loop) | same | {WNUT_EPOCHS} | {loop['seconds']:.0f} | entity F1 {loop['entity_f1']:.4f} | "
        f"ftflow/loop {wall / loop['seconds']:.2f}x, target <= {WNUT_LOOP_RATIO}x |"
    )
    token_rate, sequence_rate = inference_rates(folder, model, source / files["test"])
    print(
        f"| wnut17 inference | test texts | | | token {token_rate:,.1f} rows/s, single-label {sequence_rate:,.1f} "
        f"rows/s | {token_rate / sequence_rate:.2f}x, target >= {WNUT_INFERENCE_RATIO}x |"
    )


def inference_rates(folder: Path, model: str, test: Path) -> tuple[float, float]:
    """`ftflow infer` rows/s over the test sentences as raw text: the token classifier, then a single-label
    classifier of the same encoder (its head untrained: the speed is the encoder's and the labelling's)."""
    texts = folder / "texts.jsonl"
    lines = test.read_text(encoding="utf-8").split("\n")
    sentences, words = [], []
    for line in lines:
        if line.strip():
            words.append(line.split("\t")[0])
        elif words:
            sentences.append(" ".join(words))
            words = []
    texts.write_text("".join(json.dumps({"text": text}) + "\n" for text in sentences))
    single = folder / "single-label"
    script = (
        "import sys; from transformers import AutoModelForSequenceClassification as M, AutoTokenizer as T; "
        "M.from_pretrained(sys.argv[1], num_labels=2).save_pretrained(sys.argv[2]); "
        "T.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", script, default_model(), str(single)], env=environment(), check=True)
    rates = []
    for name, labeller in (("token", model), ("single", str(single))):
        done = subprocess.run(
            [*FTFLOW, "infer", labeller, str(texts), str(folder / f"{name}-labels")],
            env=environment(),
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(f"{name} inference failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rates.append(
            float(
                next(line for line in done.stdout.splitlines() if line.startswith("rows/s:"))
                .split()[-1]
                .replace(",", "")
            )
        )
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="*", default=["goemotions", "emobank", "pairs"])
    parser.add_argument("--rows", type=int, default=12_000, help="The most training rows a run takes.")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    print("| data | training rows | epochs | whole run s | test | against |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        with tempfile.TemporaryDirectory() as folder:
            globals()[run](Path(folder), args.rows, args.epochs)


if __name__ == "__main__":
    main()
