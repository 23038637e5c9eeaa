"""Shared by every stage, on either side: nothing here imports Prefect, so a Ray worker may import any
of it (the Prefect side's shared modules are tasks/prefect_side/; tests/test_layout.py holds both).
config (the typed parameters), data (readers and checks), storage (the layout, RunStore), cluster and
jobs (where Ray work runs), progress (ticks), reaper, text (tokenizer core, padding), first_token."""
