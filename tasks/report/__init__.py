"""After the stages: task.py (the run report), manifest.py (manifest.json, written last),
tracking.py (the MLflow run), plots.py (its pictures), stopwatch.py (the
flow's clock). All of it is the Prefect side; the flows take it from here."""

from tasks.report.manifest import DataRecord, Outputs, Results, write_manifest
from tasks.report.stopwatch import Stopwatch
from tasks.report.task import publish_inference_report, publish_report
from tasks.report.tracking import import_beside, track

__all__ = [
    "DataRecord",
    "Outputs",
    "Results",
    "Stopwatch",
    "import_beside",
    "publish_inference_report",
    "publish_report",
    "track",
    "write_manifest",
]
