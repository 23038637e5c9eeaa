"""The `batch_infer` flow: a trained model over any number of files, Parquet predictions out."""

from __future__ import annotations

from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from tasks.checks import inference_model
from tasks.config import (
    DEVICE,
    INFERENCE_PRECISION,
    WINDOW_ROWS,
    Device,
    InferenceConfig,
    InferencePrecision,
    default_storage_root,
)
from tasks.infer import predict_files
from tasks.reaper import reap_on_exit
from tasks.report import Stopwatch, publish_inference_report


@flow(name="batch_infer")
def batch_infer(
    model_uri: Annotated[
        str,
        Field(
            description="A model folder (local or s3://), or models/<name>@champion: "
            "the registry's champion under storage_root."
        ),
    ],
    input_uri: str | list[str],
    output_uri: str,
    text_column: str = "text",
    id_column: str | None = None,
    batch_size: Annotated[int, Field(ge=1)] = 64,
    window_rows: Annotated[
        int,
        Field(
            ge=1, description="Rows sorted by length and labelled together: with batch_size, bounds memory per actor."
        ),
    ] = WINDOW_ROWS,
    actors: Annotated[int | None, Field(ge=1, description=InferenceConfig.model_fields["actors"].description)] = None,
    device: Annotated[Device, Field(description=DEVICE)] = "auto",
    precision: Annotated[InferencePrecision, Field(description=INFERENCE_PRECISION)] = "auto",
    wait_for_actors_s: Annotated[
        float, Field(gt=0, description=InferenceConfig.model_fields["wait_for_actors_s"].description)
    ] = 600,
    timeout_s: Annotated[
        float | None, Field(gt=0, description=InferenceConfig.model_fields["timeout_s"].description)
    ] = None,
    ray_address: str | None = None,
    storage_root: Annotated[
        str | None, Field(description="Where models/ is; default: FTFLOW_STORAGE_ROOT or ./artifacts.")
    ] = None,
) -> dict:
    """Label every row of the input files (files, directories or globs; local or s3://) with model_uri."""
    reap_on_exit()  # this process's Prefect server and local Ray end with it, even if it is killed
    resolved = inference_model(model_uri, storage_root or default_storage_root())  # before any cluster work
    cfg = InferenceConfig(
        input_uri=input_uri,
        text_column=text_column,
        id_column=id_column,
        batch_size=batch_size,
        window_rows=window_rows,
        actors=actors,
        device=device,
        precision=precision,
        wait_for_actors_s=wait_for_actors_s,
        timeout_s=timeout_s,
    )
    with Stopwatch(get_run_logger())("batch inference"):
        result = predict_files.with_options(timeout_seconds=timeout_s)(resolved, cfg, output_uri, ray_address)
    publish_inference_report(model_uri, resolved, flow_run.parameters, result)
    return result
