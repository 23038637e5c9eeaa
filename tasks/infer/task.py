"""Stage 4, the Prefect side: the `predict_files` task, its progress artifact and throughput table
(its Ray work is tasks/infer/driver.py), and `write_test_labels`, the finetune flow's batch inference
of the test split, which evaluation has just labelled (tasks/infer/labels.py)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.contracts.labels import Labelled
from tasks.contracts.training import Result
from tasks.core import jobs
from tasks.core.config import InferenceConfig
from tasks.core.data import Split
from tasks.infer.driver import labelled
from tasks.infer.labels import from_predictions
from tasks.prefect_side.live import Tracked
from tasks.prefect_side.retries import RETRY_TRANSIENT

# The stage's progress artifact in the UI: key, description.
PROGRESS = ("batch-inference-progress", "Batch inference: % of the rows labelled (estimated until every part is read)")
# What batch inference writes of a row, in words, by task: a regression model's are numbers, not labels.
WRITTEN = {"single_label": "labels", "multi_label": "labels", "regression": "scores"}


@task(**RETRY_TRANSIENT)
def predict_files(model_uri: str, cfg: InferenceConfig, output_uri: str, ray_address: str | None = None) -> Labelled:
    """Label every row of every file cfg.input_uri names; Parquet (id, text, label, score) at
    output_uri, complete once output_uri/_SUCCESS.json exists (rows, input and model fingerprints).
    The flows check the inputs first (tasks/validate/checks.py)."""
    with Tracked(*PROGRESS) as progress:
        result = jobs.run(labelled, ray_address, progress, model_uri=model_uri, cfg=cfg, output_uri=output_uri)
    throughput_artifact(result, f"{model_uri} over {result.files} file(s), labels in {output_uri}")
    return result


@task(**RETRY_TRANSIENT)
def write_test_labels(training: Result, test: Split, model_uri: str, cfg: InferenceConfig, output_uri: str) -> Labelled:
    """Batch inference of the test split, whose rows the trained engine labelled for evaluation: those
    labels, written as predict_files writes the model's (no model is loaded again)."""
    written = WRITTEN[test.schema.task]
    with Tracked(*PROGRESS) as progress:
        result = from_predictions(training.test, training.thresholds, test, model_uri, cfg, output_uri)
        progress.info(
            "wrote the %d test rows' %s, as evaluation predicted them, in %.1f s", result.rows, written, result.seconds
        )
    throughput_artifact(
        result, f"{model_uri}'s {written} of the test split, as evaluation predicted them, in {output_uri}"
    )
    return result


def throughput_artifact(result: Labelled, description: str) -> None:
    create_table_artifact(
        key="batch-inference-throughput", table=[result.model_dump(exclude={"output_uri"})], description=description
    )
