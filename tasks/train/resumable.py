"""Whether a run's last checkpoint can go on with the workers this run has, asked by the driver before
any worker starts. Asked by the workers instead, a refusal is an error Ray Train retries: the worker
group started max_failures + 1 times to say the same line."""

from __future__ import annotations

from tasks.core import storage
from tasks.core.train_config import TrainConfig
from tasks.train.spec import Progress
from tasks.train.trainer import RUN_NAME

# Rank 0 writes it beside the DeepSpeed state of every checkpoint (tasks/train/checkpoints.py save).
PROGRESS_FILE = "progress.json"


def latest_progress(train_dir: str) -> Progress | None:
    """Where the run's latest checkpoint stands (Ray Train resumes from it: its step is the highest),
    or None where it has none, or only checkpoints saved before ftflow wrote PROGRESS_FILE."""
    fs, path = storage.filesystem(train_dir)
    saved = [
        Progress.model_validate_json(fs.cat_file(found)) for found in fs.glob(f"{path}/{RUN_NAME}/*/{PROGRESS_FILE}")
    ]
    return max(saved, key=lambda progress: progress.step, default=None)


def resume_refused(progress: Progress, world_size: int, cfg: TrainConfig) -> str | None:
    """Why a checkpoint cannot go on at this world size, if it cannot: a tensor- or pipeline-parallel one
    is not re-partitioned (tasks/train/reshard.py). A data-parallel one goes on at any, mid-epoch too
    (tasks/train/passes.py)."""
    if progress.world_size in (None, world_size) or cfg.model_parallel == 1:
        return None
    return (
        f"the checkpoint at step {progress.step} was taken by {progress.world_size} worker(s), and this run has "
        f"{world_size}: a {cfg.split_field}={cfg.model_parallel} run resumes with num_workers={progress.world_size}"
    )
