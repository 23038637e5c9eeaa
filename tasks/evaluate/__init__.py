"""Stage 3. task.py: the Prefect task and its artifacts; contract.py: Metrics, from the labels training gave."""
