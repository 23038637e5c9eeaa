"""`ftflow doctor`: checks.py drives the checks (`run`, each a `Check`); worker.py is their work on the
cluster's workers."""

from tasks.doctor.checks import Check, run

__all__ = ["Check", "run"]
