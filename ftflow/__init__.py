"""The `ftflow` command, on top of everything: cli (the commands), params (--set and --params read into
the flows' typed parameters), console (what a person reads in the terminal) and temporary_api (the
Prefect API a command starts when none is configured). Nothing below imports it (tests/test_layout.py)."""
