"""A checkpoint written by another number of data-parallel workers, loaded exactly: what lets a run go on
after it lost a node, or was given more.

DeepSpeed ties a ZeRO checkpoint to the world size that wrote it (each rank saved its partition of the
fp32 weights and Adam's moments, and `load_checkpoint` refuses another size). Its universal checkpoint
re-partitions them: the converter (deepspeed/checkpoint/ds_to_universal.py) writes each parameter's
whole fp32 weight, exp_avg and exp_avg_sq, and the engine loads its own partition of each, by copies
alone, so the moments come back bit for bit. ZeRO-0's checkpoint is every rank's whole optimizer and
loads at any size as it is. Pipeline and tensor-parallel groups are not resized: resuming one at another
world size is refused by the driver before any worker starts (tasks/train/resumable.py).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from argparse import Namespace
from pathlib import Path

import torch

TAG = "state"  # the tag every checkpoint is saved under (tasks/train/checkpoints.py)
UNIVERSAL_TAG = "universal"


def saved_world_size(folder: str) -> int | None:
    """How many data-parallel ranks wrote the checkpoint in `folder`: one ZeRO optimizer partition each
    (bf16_ names under the bf16 optimizer); None for ZeRO-0, which keeps no partitions."""
    partitions = list(Path(folder, TAG).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return len(partitions) or None


def needs_resharding(engine, folder: str) -> bool:
    saved = saved_world_size(folder)
    return saved is not None and saved != engine.dp_world_size


def load_resharded(engine, folder: str, strict: bool) -> dict:
    """Load a ZeRO checkpoint written at another world size into `engine`: converted to DeepSpeed's
    universal form in a scratch folder of this worker, then loaded; its client state."""
    with tempfile.TemporaryDirectory() as scratch:
        universal(folder, scratch)
        engine._config.load_universal_checkpoint = True  # DeepSpeed reads it at load; no argument takes it
        try:
            client_state = engine.load_checkpoint(scratch, tag=UNIVERSAL_TAG, load_module_strict=strict)[1]
        finally:
            engine._config.load_universal_checkpoint = False  # the run's own checkpoints load as saved
        if engine.zero_optimization_stage() == 3:
            mend_zero3_optimizer(engine, Path(scratch, UNIVERSAL_TAG))
    return client_state


def universal(folder: str, scratch: str) -> None:
    """DeepSpeed's converter, in this process (one worker each: it runs where the checkpoint was
    downloaded), its progress lines kept off the run's console. inject_missing_state: the version
    record the converter asks for, which DeepSpeed writes only for its own tensor-parallel models."""
    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(
        input_folder=str(Path(folder, TAG)),
        output_folder=str(Path(scratch, UNIVERSAL_TAG)),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def mend_zero3_optimizer(engine, converted: Path) -> None:
    """Two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong (stage3.py
    load_hp_checkpoint_state_from_checkpoint_dir_stage3), put right:
    - it gives every parameter group the first group's hyperparameters: the biases' and norms' group
      would decay as the weights do. Each group gets its own back from the saved optimizer.
    - it hands one step tensor to every sub-group, and torch's AdamW adds 1 to it in place at each
      sub-group's step: the bias correction would run ahead. Each sub-group gets its own copy."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    saved = torch.load(converted / "zero" / "optimizer_state.pt", weights_only=False)[OPTIMIZER_STATE_DICT]
    optimizer = engine.optimizer.optimizer
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        state = optimizer.state[flat]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
