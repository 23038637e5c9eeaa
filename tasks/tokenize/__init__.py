"""Stage 1. task.py: the Prefect task (cached by content); driver.py: the Ray job (key, tokenizer,
shard tasks); worker.py: what each Ray task runs. The shards' schema is tasks/contracts/shards.py.
What the flows use besides the task: the shard set's content key, checked before any cluster work."""

from tasks.tokenize.driver import TokenizeKey, checked_key

__all__ = ["TokenizeKey", "checked_key"]
