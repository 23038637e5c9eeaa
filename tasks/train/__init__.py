"""Stage 2. task.py: the Prefect tasks; driver.py: the Ray job (Ray Train), with plan.py,
deepspeed_config.py, ingest.py and trainer.py; worker.py: each Ray Train worker's loop, with
engine.py, batches.py, stream.py, replica.py and pipeline.py; contract.py: the typed messages between
them; strategy.py: strategy=auto; watch.py, stall.py and stall_node.py: heartbeats, failures, stalls."""
