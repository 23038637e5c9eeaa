"""Shared by every stage: config (the typed parameters), data (readers and checks), storage (the
layout, RunStore), cluster and jobs (where Ray work runs), progress and live (ticks), retries,
reaper, events, text (tokenizer core, padding), first_token."""
