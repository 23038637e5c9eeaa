"""Long inputs (issue 56): a small Llama-style classifier (4,096 positions) trained 2 steps on documents of
the shipped reviews joined end to end, every row cut at model.max_length, at lengths up to the model's
positions, with and without activation checkpointing: training samples/s, tokens/s, the peak memory per
worker and strategy=auto's estimate beside it. One worker with every CPU, global batch 4.

    python bench/long_inputs.py [--lengths 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from estimates import documents, llama, measured

from tasks.core import cluster
from tasks.core.train_config import TrainConfig

SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 688}
POSITIONS = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    args = parser.parse_args()
    cluster.connect()
    print("| max_length | activation checkpointing | samples/s | tokens/s | peak GiB | estimate GiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        data = documents(Path(folder))
        model = llama(Path(folder), "long", SHAPE, positions=POSITIONS)
        for length in map(int, args.lengths.split(",")):
            for checkpointing in (False, True):
                cfg = TrainConfig(
                    max_steps=2,
                    batch_size=4,
                    num_workers=1,
                    eval_every_steps=0,
                    keep_best=False,
                    activation_checkpointing=checkpointing,
                )
                name = f"long-{length}-{checkpointing}"
                run = measured(model, folder, name, cfg, length=length, data=data)
                print(
                    f"| {length} | {'on' if checkpointing else 'off'} | {run['samples/s']:.2f} | "
                    f"{run['samples/s'] * length:.0f} | {run['peak']:.2f} | {run['need']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
