"""Stage 4. task.py: the Prefect task; driver.py: the Ray job (parts, Ray Data pipeline); worker.py:
the Labeller actor; predictor.py: texts to labels, shared with evaluation."""
