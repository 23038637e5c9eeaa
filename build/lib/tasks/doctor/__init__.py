"""`ftflow doctor`: checks.py drives the checks; worker.py is their work on the cluster's workers."""
