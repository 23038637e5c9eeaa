"""Stage 1. task.py: the Prefect task (cached by content); driver.py: the Ray job (key, tokenizer,
shard tasks); worker.py: what each Ray task runs; contract.py: the shards' schema."""
