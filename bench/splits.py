"""Every model family ftflow splits (tasks/core/models.py SPLITTABLE), tiny and random, trained 4 steps on
the shipped reviews as data parallelism over 2 workers, as one tensor-parallel group of 2 and as 2
pipeline stages, in fp32: the largest relative difference of each split's per-step training loss from
data parallelism's, and the share of the layers' parameters a worker holds. The encoders train with
dropout, which a split draws differently (a difference of about 1e-3); the decoders have none.

    python bench/splits.py [--families llama,deberta-v2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from estimates import DATA, fitted  # noqa: E402
from tiny_model import tiny_bpe_tokenizer, tiny_decoder, tiny_random_model  # noqa: E402

from tasks.core import cluster  # noqa: E402
from tasks.core.models import SPLITTABLE, SPLITTABLE_DECODERS  # noqa: E402
from tasks.core.train_config import TrainConfig  # noqa: E402

RUN = {"max_steps": 4, "batch_size": 16, "micro_batch_size": 4, "num_workers": 2, "learning_rate": 1e-3}
SPLITS = {"tensor_parallel_size": "tp2", "pipeline_parallel_size": "pp2"}


def tiny(folder: Path, family: str) -> Path:
    """A tiny random classifier of the family with its tokenizer: a decoder's byte-level BPE learnt on the
    reviews, an encoder's the suite's tiny WordPiece vocabulary."""
    if family in SPLITTABLE_DECODERS:
        texts = [json.loads(line)["text"] for line in (DATA / "train.jsonl").read_text().split("\n")[:2000]]
        return tiny_decoder(folder / family, family, tiny_bpe_tokenizer(texts))
    return tiny_random_model(folder / family, family)


def trained(model: Path, root: str, name: str, **split) -> tuple[list[float], float]:
    """The per-step training losses and the layer parameters a worker held, of RUN split as `split` says."""
    cfg = TrainConfig(**RUN, **split, eval_every_steps=0, log_every_steps=1)
    result = fitted(model, root, name, cfg, length=64, data=DATA)
    return [point.loss for point in result.curve.train], result.layer_parameter_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    families = sorted(set().union(*SPLITTABLE.values()))
    parser.add_argument("--families", default=",".join(families))
    args = parser.parse_args()
    cluster.connect()
    print("| family | split | largest relative loss difference from data parallelism | layer parameters held |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families.split(","):
            model = tiny(Path(folder), family)
            losses, whole = trained(model, folder, f"{family}-dp")
            for field, name in SPLITS.items():
                if family in SPLITTABLE[field]:
                    split, held = trained(model, folder, f"{family}-{name}", **{field: 2})
                    worst = max(abs(a - b) / abs(b) for a, b in zip(split, losses, strict=True))
                    print(f"| {family} | {name} | {worst:.1e} | {held / whole:.2f} |", flush=True)


if __name__ == "__main__":
    main()
