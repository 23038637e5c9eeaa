"""The job a user would write instead of ftflow, in one process with the HF Trainer: tokenize the
shipped reviews, train one epoch of ftflow's defaults (model, hyperparameters, length grouping,
validation every 100 steps and at the last), predict the test split once (its metrics and its
labels, written to Parquet), save the model. bench/end_to_end.py times it against `ftflow run`.

    python bench/trainer_job.py OUTPUT_DIR [MAX_STEPS]

Its last line is JSON: wall-clock marks (time.time()) of its phases, and the test accuracy.
"""

import time

STARTED = time.time()

import json  # noqa: E402 -- the imports are a phase of the job
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tasks.core.config import FinetuneParams  # noqa: E402 -- ftflow's defaults, nothing else of it

IMPORTED = time.time()
DATA = Path(__file__).resolve().parents[1] / "data" / "rotten_tomatoes"


class FirstStep(TrainerCallback):
    """When the first optimizer step ended."""

    at = None

    def on_step_end(self, args, state, control, **kwargs):
        self.at = self.at or time.time()


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main(output: Path, max_steps: int) -> None:
    defaults = FinetuneParams()
    model_path, train = defaults.model.name_or_path, defaults.train
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    splits = load_dataset("json", data_files={s: str(DATA / f"{s}.jsonl") for s in ("train", "validation", "test")})
    tokenized = splits.map(
        lambda rows: tokenizer(rows["text"], truncation=True, max_length=defaults.model.max_length), batched=True
    )
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    steps = max_steps or len(tokenized["train"]) // train.batch_size
    args = TrainingArguments(
        output_dir=str(output / "trainer"),
        per_device_train_batch_size=train.batch_size,
        per_device_eval_batch_size=defaults.inference.batch_size,
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
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
        callbacks=[first_step],
    )
    trainer.train()  # validated every eval_steps and at its last step, as ftflow's defaults do
    trained = time.time()
    test = trainer.predict(tokenized["test"])  # the test metrics and its labels in one pass
    probabilities = torch.from_numpy(test.predictions).float().softmax(-1).numpy()
    labels = probabilities.argmax(-1)
    pq.write_table(
        pa.table(
            {
                "id": [f"test.jsonl:{i}" for i in range(len(labels))],
                "text": splits["test"]["text"],
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


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
