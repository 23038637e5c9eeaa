"""Stage 2. task.py: the Prefect tasks; driver.py: the Ray job (plan, DeepSpeed JSON, Ray Train);
worker.py: each Ray Train worker's loop; contract.py: the typed messages between them; batches.py,
replica.py, pipeline.py, devices.py: the worker's parts; strategy.py: strategy=auto; watch.py and
stall.py: heartbeats, failures and stalls."""
