"""strategy=auto's memory estimate against the measured peak (issue 56): Llama-style decoders of a tiny and
a mid size (grouped-query attention, a 32,000-token vocabulary), trained a few steps on the shipped reviews
under each strategy on this machine's CPUs, full fine-tuning and LoRA, on documents of the reviews
that fill model.max_length (the batches an estimate plans for). Per run: the estimate per worker
(tasks/train/strategy.py need_bytes, as strategy=auto computes it), the measured peak per worker (the
largest resident set of any worker), and their ratio. Target: within 25%.

    python bench/estimates.py [--sizes tiny,mid] [--only zero0,lora-zero3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from tiny_model import tiny_bpe_tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForSequenceClassification  # noqa: E402

from tasks.contracts.training import Result, TrainingJob  # noqa: E402
from tasks.core import cluster  # noqa: E402
from tasks.core.config import DataConfig, ModelConfig  # noqa: E402
from tasks.core.data import load_splits  # noqa: E402
from tasks.core.layout import RunStore  # noqa: E402
from tasks.core.train_config import Lora, TrainConfig  # noqa: E402
from tasks.tokenize.driver import tokenize_key  # noqa: E402
from tasks.tokenize.task import tokenize  # noqa: E402
from tasks.train import strategy  # noqa: E402
from tasks.train.plan import plan_of  # noqa: E402
from tasks.train.task import train  # noqa: E402

DATA = ROOT / "data" / "rotten_tomatoes"
MAX_LENGTH = 128
SIZES = {  # Llama-style, 4 query heads per key-value head
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 176},
    "mid": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 16, "intermediate_size": 2048},
}
RUN = {"max_steps": 2, "batch_size": 16, "num_workers": 2, "eval_every_steps": 0, "keep_best": False}
STRATEGIES = {
    "zero0-1w": {"zero_stage": 0, "num_workers": 1},
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "lora-zero0": {"zero_stage": 0, "lora": Lora()},
    "lora-zero3": {"zero_stage": 3, "lora": Lora()},
}


def llama(folder: Path, name: str, shape: dict, positions: int = MAX_LENGTH, weights: bool = True) -> Path:
    """A random Llama-style classifier of the shape (4 query heads per key-value head), its tokenizer
    learnt on the reviews (the vocabulary 32,000 all the same: a large model's embeddings), saved; without
    `weights`, its config alone (for model.init: random)."""
    texts = [json.loads(line)["text"] for line in (DATA / "train.jsonl").read_text().split("\n")[:2000]]
    tokenizer = tiny_bpe_tokenizer(texts)
    special = dict.fromkeys(("bos_token_id", "eos_token_id"), tokenizer.eos_token_id)
    kv_heads = {"num_key_value_heads": shape["num_attention_heads"] // 4}
    config = AutoConfig.for_model(
        "llama", vocab_size=32000, num_labels=2, max_position_embeddings=positions, **special, **shape, **kv_heads
    )
    if weights:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            AutoModelForSequenceClassification.from_config(config).save_pretrained(folder / name)
    else:
        config.save_pretrained(folder / name)
    tokenizer.save_pretrained(folder / name)
    return folder / name


def documents(folder: Path, rows: int = 64, validation_rows: int | None = None) -> Path:
    """Train, validation and test splits of `rows` documents (validation and test: `validation_rows` of
    them, if given), each about 8,000 words of consecutive reviews."""
    reviews = [json.loads(line) for line in (DATA / "train.jsonl").read_text().strip().split("\n")]
    per_document = len(reviews) // rows
    for split in ("train", "validation", "test"):
        lines = [
            json.dumps(
                {
                    "text": " ".join(r["text"] for r in reviews[i * per_document : (i + 1) * per_document]),
                    "label": reviews[i * per_document]["label"],
                }
            )
            for i in range(validation_rows if validation_rows and split != "train" else rows)
        ]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def fitted(
    model: Path,
    root: str,
    name: str,
    cfg: TrainConfig,
    length: int = MAX_LENGTH,
    data: Path = DATA,
    init: str = "pretrained",
) -> Result:
    """cfg trained on data's train, validation and test splits (JSONL), tokenized for the model at `length`, as
    run `name` under `root`, the model's weights as `init` says (ModelConfig.init)."""
    splits = load_splits(DataConfig(**{f"{s}_uri": str(data / f"{s}.jsonl") for s in ("train", "validation", "test")}))
    key = tokenize_key(splits, str(model), length, root)
    shards = tokenize.with_options(refresh_cache=not key.shards_exist())(key, splits, str(model))
    job = TrainingJob(
        shards=shards,
        model=ModelConfig(name_or_path=str(model), max_length=length, init=init),
        targets=splits["train"].targets,
        train=cfg,
        store=RunStore.at(f"{root}/runs/{name}"),
    )
    return train(job)


def need_gib(model: Path, cfg: TrainConfig, length: int = MAX_LENGTH) -> tuple[float, int]:
    """strategy=auto's need per worker (GiB) for cfg on this cluster, planned as a run plans it, and its workers."""
    resources = cluster.Resources.of_cluster()
    the_plan, use_gpu = plan_of(cfg, resources), resources.use_gpu(cfg.device)
    size = strategy.ModelSize.of(str(model), 2)
    need = strategy.need_bytes(size, cfg, the_plan.workers, the_plan.micro_batch, length, use_gpu)
    return need / strategy.GIB, the_plan.workers


def measured(
    model: Path,
    root: str,
    name: str,
    cfg: TrainConfig,
    length: int = MAX_LENGTH,
    data: Path = DATA,
    init: str = "pretrained",
) -> dict:
    """A run of cfg (fitted): its estimated and peak GiB per worker, its workers and its training samples/s."""
    need, workers = need_gib(model, cfg, length)
    last = fitted(model, root, name, cfg, length, data, init).history[-1]
    peak = last.peak_memory_mb * 2**20 / strategy.GIB
    return {"need": need, "peak": peak, "workers": workers, "samples/s": last.samples_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--only", default=",".join(STRATEGIES))
    args = parser.parse_args()
    cluster.connect()
    print("| model | parameters | strategy | workers | estimate GiB | peak GiB | estimate / peak |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        data = documents(Path(folder))  # every row max_length tokens: the batches an estimate plans for
        for size in args.sizes.split(","):
            model = llama(Path(folder), size, SIZES[size])
            params = strategy.ModelSize.of(str(model), 2).params
            for name in args.only.split(","):
                cfg = TrainConfig(**(RUN | STRATEGIES[name]))
                run = measured(model, folder, f"{size}-{name}", cfg, data=data)
                print(
                    f"| llama {size} | {params / 1e6:.1f} M | {name} | {run['workers']} | {run['need']:.2f} | "
                    f"{run['peak']:.2f} | {run['need'] / run['peak']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
