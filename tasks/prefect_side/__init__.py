"""What the stages' Prefect tasks and the flows share, and only they: each module imports Prefect, so
none may be imported in a Ray worker (tasks/core/ is what may). live: a stage's progress artifact;
retries: which failures a task retries; events: ftflow's Prefect events."""
