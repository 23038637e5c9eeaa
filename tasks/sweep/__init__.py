"""Stage 2 of the `sweep` flow, in place of a run's training: trials drawn from a search space, each
trained as the train stage trains (tasks/train/driver.py), under a Ray Tune scheduler."""
