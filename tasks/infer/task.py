"""Stage 4, the Prefect side: the `predict_files` task, its progress artifact and throughput table.
Its Ray work is tasks/infer/driver.py."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.core import jobs
from tasks.core.config import InferenceConfig
from tasks.core.live import Tracked
from tasks.core.retries import RETRY_TRANSIENT
from tasks.infer.driver import Labelled, labelled


@task(**RETRY_TRANSIENT)
def predict_files(model_uri: str, cfg: InferenceConfig, output_uri: str, ray_address: str | None = None) -> Labelled:
    """Label every row of every file cfg.input_uri names; Parquet (id, text, label, score) at
    output_uri, complete once output_uri/_SUCCESS.json exists (rows, input and model fingerprints).
    The flows check the inputs first (tasks/validate/checks.py)."""
    with Tracked(
        "batch-inference-progress", "Batch inference: % of the rows labelled (estimated until every part is read)"
    ) as progress:
        result = jobs.run(labelled, ray_address, progress, model_uri=model_uri, cfg=cfg, output_uri=output_uri)
    create_table_artifact(
        key="batch-inference-throughput",
        table=[result.model_dump(exclude={"output_uri"})],
        description=f"{model_uri} over {result.files} file(s), labels in {output_uri}",
    )
    return result
