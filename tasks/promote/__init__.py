"""Stage 3b. task.py: the promotion gate; rescore.py: a champion scored again. Its Decision and the
registry's champion pointers are tasks/contracts/promotion.py."""
