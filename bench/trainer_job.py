"""The job a user would write instead of ftflow, in one process with the HF Trainer: tokenize the
shipped reviews, train one epoch of ftflow's defaults (model, hyperparameters, length grouping,
validation every 100 steps and at the last), predict the test split once (its metrics and its
labels, written to Parquet), save the model. bench/end_to_end.py times it against `ftflow run`.

    python bench/trainer_job.py OUTPUT_DIR [--max-steps N] [--set train.batch_size=256 ...]
                                [--attention torch|no-cudnn]

`--set` takes ftflow's fields, as `ftflow run` does (the model, the batch size: what the job shares
with ftflow's run). On a GPU it trains in bf16, with torch's default attention kernel or, as ftflow's
workers run (tasks/core/attention.py), without cuDNN's. It reads the splits with plain Python, not
`datasets` (the bare GPU machine lacks it).

Its last line is JSON: wall-clock marks (time.time()) of its phases, and the test accuracy.
"""

import time

STARTED = time.time()

import argparse  # noqa: E402 -- the imports are a phase of the job
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ftflow.params import parameters  # noqa: E402 -- ftflow's fields and defaults, nothing else of it
from tasks.core.attention import without_cudnn_attention  # noqa: E402
from tasks.core.config import FinetuneParams  # noqa: E402

IMPORTED = time.time()
DATA = Path(__file__).resolve().parents[1] / "data" / "rotten_tomatoes"


class FirstStep(TrainerCallback):
    """When the first optimizer step ended."""

    at = None

    def on_step_end(self, args, state, control, **kwargs):
        self.at = self.at or time.time()


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def tokenized(split: str, tokenizer, max_length: int) -> tuple[list[str], list[dict]]:
    """A split's texts, and its rows as the Trainer takes them (token ids and the label)."""
    with (DATA / f"{split}.jsonl").open() as lines:  # not splitlines(): a review holds a U+2028
        rows = [json.loads(line) for line in lines]
    texts = [row["text"] for row in rows]
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    return texts, [{name: encoded[name][i] for name in encoded} | {"label": row["label"]} for i, row in enumerate(rows)]


def main(output: Path, max_steps: int, params: FinetuneParams) -> None:
    model_path, train = params.model.name_or_path, params.train
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    splits = {split: tokenized(split, tokenizer, params.model.max_length) for split in ("train", "validation", "test")}
    tokenized_rows = {split: rows for split, (_, rows) in splits.items()}
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    steps = max_steps or len(tokenized_rows["train"]) // train.batch_size
    args = TrainingArguments(
        output_dir=str(output / "trainer"),
        per_device_train_batch_size=train.batch_size,
        per_device_eval_batch_size=params.inference.batch_size,
        num_train_epochs=train.epochs,
        max_steps=max_steps or -1,
        learning_rate=train.learning_rate,
        warmup_steps=int(steps * train.warmup_ratio),
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        train_sampling_strategy="group_by_length",
        eval_strategy="steps",
        eval_steps=train.eval_every_steps,
        logging_steps=train.log_every_steps,
        save_strategy="no",
        seed=train.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        report_to=[],
        disable_tqdm=True,
    )
    first_step = FirstStep()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=tokenized_rows["train"],
        eval_dataset=tokenized_rows["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
        callbacks=[first_step],
    )
    trainer.train()  # validated every eval_steps and at its last step, as ftflow's defaults do
    trained = time.time()
    test = trainer.predict(tokenized_rows["test"])  # the test metrics and its labels in one pass
    probabilities = torch.from_numpy(test.predictions).float().softmax(-1).numpy()
    labels = probabilities.argmax(-1)
    pq.write_table(
        pa.table(
            {
                "id": [f"test.jsonl:{i}" for i in range(len(labels))],
                "text": splits["test"][0],
                "label": labels,
                "score": probabilities[np.arange(len(labels)), labels],
            }
        ),
        output / "predictions.parquet",
    )
    trainer.save_model(str(output / "model"))
    tokenizer.save_pretrained(str(output / "model"))
    marks_json = {
        "started": STARTED,
        "imported": IMPORTED,
        "first_step": first_step.at,
        "trained": trained,
        "ended": time.time(),
        "test_accuracy": test.metrics["test_accuracy"],
    }
    print(json.dumps(marks_json))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--max-steps", type=int, default=0, help="optimizer steps (0: one epoch)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="one of ftflow's fields")
    parser.add_argument("--attention", choices=("torch", "no-cudnn"), default="torch")
    return parser.parse_args()


if __name__ == "__main__":
    args = arguments()
    if args.attention == "no-cudnn":
        without_cudnn_attention()
    main(args.output, args.max_steps, parameters(FinetuneParams, None, args.sets))
