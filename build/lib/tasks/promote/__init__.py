"""Stage 3b. task.py: the promotion gate; registry.py: the champion pointers in storage."""
