"""Stage 3. task.py: the Prefect task and its artifacts; the Metrics it writes are tasks/contracts/metrics.py."""
