"""Stage 3b. task.py: the promotion gate; rescore.py: a champion scored again; contract.py: the
Decision and the champion pointers in storage."""
