"""Stage 4. task.py: the Prefect task; driver.py: the Ray job (parts, Ray Data pipeline); worker.py:
the Labeller actor; labels.py: what is written. What it reads and hands on (Reading, the labels'
schema, Labelled) is tasks/contracts/labels.py."""
