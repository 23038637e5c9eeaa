"""Before any cluster work: the data, the model, the files to label and storage (checks.py)."""
