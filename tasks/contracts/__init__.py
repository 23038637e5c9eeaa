"""What the stages hand each other, typed, one floor under the stages: a stage imports tasks/core/ and
these, and no other stage's modules. shards (tokenization's Parquet rows), training (the training job
and its Result, with the predictions), metrics (evaluation's), promotion (the gate's Decision and the
registry's champion pointers), labels (what batch inference reads and writes), sweep (its trials).
They import tasks/core/ only, and no Prefect, Ray or torch: a Ray worker may import any of them."""
