"""Stage 4. task.py: the Prefect task; driver.py: the Ray job (parts, Ray Data pipeline); worker.py:
the Labeller actor; labels.py: what is written; contract.py: Labelled and the labels' schema."""
