"""The `batch_infer` flow: a trained model over any number of files, Parquet predictions out."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from tasks.contracts.labels import Labelled
from tasks.core.config import BatchInferParams
from tasks.core.reaper import reap_on_exit
from tasks.infer.task import predict_files
from tasks.report import Stopwatch, publish_inference_report
from tasks.validate import batch_infer_inputs


@flow(name="batch_infer")
def batch_infer(params: BatchInferParams) -> Labelled:
    """Label every row of the input files (files, directories or globs; local or s3://) with a model."""
    reap_on_exit()  # this process's Prefect server and local Ray end with it, even if it is killed
    # Bad input stops here, before any cluster work (`ftflow infer` checked it before Prefect started).
    model_uri = batch_infer_inputs(params)
    cfg = params.inference
    with Stopwatch(get_run_logger())("batch inference"):
        result = predict_files.with_options(timeout_seconds=cfg.timeout_s)(
            model_uri, cfg, params.output_uri, params.ray_address
        )
    publish_inference_report(params.model_uri, model_uri, flow_run.parameters["params"], result)
    return result
