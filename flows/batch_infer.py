"""The `batch_infer` flow: a trained model over any number of files, Parquet predictions out."""

from __future__ import annotations

from typing import Annotated

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from tasks.config import WINDOW_ROWS, default_storage_root
from tasks.infer import predict_files
from tasks.registry import resolve
from tasks.report import publish_inference_report


@flow(name="batch_infer")
def batch_infer(
    model_uri: Annotated[str, Field(description="A model folder (local or s3://), or models/<name>@champion: "
                                                "the registry's champion under storage_root.")],
    input_uri: str | list[str],
    output_uri: str,
    text_column: str = "text",
    id_column: str | None = None,
    batch_size: Annotated[int, Field(ge=1)] = 64,
    window_rows: Annotated[
        int, Field(ge=1, description="Rows sorted by length and labelled together: with batch_size, bounds memory per actor.")
    ] = WINDOW_ROWS,
    ray_address: str | None = None,
    storage_root: Annotated[str | None, Field(description="Where models/ is; default: FTFLOW_STORAGE_ROOT or ./artifacts.")] = None,
) -> dict:
    """Label every row of the input files (files, directories or globs; local or s3://) with model_uri."""
    resolved = resolve(model_uri, storage_root or default_storage_root())
    result = predict_files(resolved, input_uri, output_uri, text_column, id_column, batch_size, ray_address, window_rows)
    publish_inference_report(model_uri, resolved, flow_run.parameters, result)
    return result
