"""The `batch_infer` flow: a trained model over any number of files, Parquet predictions out."""

from __future__ import annotations

from prefect import flow

from tasks.infer import predict_files


@flow(name="batch_infer")
def batch_infer(
    model_uri: str,
    input_uri: str,
    output_uri: str,
    text_column: str = "text",
    id_column: str | None = None,
    batch_size: int = 64,
    ray_address: str | None = None,
) -> dict:
    """Label every row under input_uri (file, directory or glob; local or s3://) with model_uri."""
    return predict_files(model_uri, input_uri, output_uri, text_column, id_column, batch_size, ray_address)
