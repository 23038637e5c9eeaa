"""The tag of every Prefect task that trains on the Ray cluster (a run's training, a sweep's trials):
a Prefect concurrency limit on it (deployments/) keeps two of them from competing for one cluster."""

TRAINING_TAG = "ray-training"
