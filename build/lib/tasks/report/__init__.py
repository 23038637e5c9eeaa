"""After the stages: task.py (the run report), manifest.py (manifest.json, written last),
tracking.py (the MLflow run)."""
