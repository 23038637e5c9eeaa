"""Shared by every stage, on either side: nothing here imports Prefect, so a Ray worker may import any
of it (the Prefect side's shared modules are tasks/prefect_side/; tests/test_layout.py holds both).
config, train_config and strict (the typed parameters), data (readers and checks), storage (fsspec
I/O), layout (where ftflow writes, and only its own), cluster and jobs (where Ray work runs),
progress (ticks), reaper, models (model folders), predictor (texts to labels), scoring (F1,
thresholds, correlations), text (tokenizer core, padding), objective, first_token, attention. The
ground floor: it imports no stage and no contract (tests/test_layout.py)."""
