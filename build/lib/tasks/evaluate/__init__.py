"""Stage 3. task.py: the Prefect task and its artifacts; driver.py: the confusion matrix on the cluster."""
