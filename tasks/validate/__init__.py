"""Before any cluster work: the data, the model, the files to label and storage (checks.py), for the
command and the flows alike."""

from tasks.validate.checks import RunInputs, batch_infer_inputs, run_inputs

__all__ = ["RunInputs", "batch_infer_inputs", "run_inputs"]
