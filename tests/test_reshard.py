"""A checkpoint written by 2 workers resumes at 1 and at 4 with every optimizer moment as it was saved:
real DeepSpeed engines in real process groups (gloo), one per rank, each ZeRO stage's optimizer class,
with and without offload."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing

from ftflow.temporary_api import free_port
from tasks.core.train_config import TrainConfig
from tasks.train.checkpoints import restore
from tasks.train.deepspeed_json import deepspeed_config
from tasks.train.engine import cpu_probed_once, join_process_group, param_groups
from tasks.train.reshard import TAG
from tasks.train.resumable import resume_refused
from tasks.train.spec import Plan, Progress

# ZeRO-1 and ZeRO-2 share one optimizer class (its universal load: stage_1_and_2.py). ZeRO-3 runs with
# torch's AdamW and with DeepSpeed's CPU Adam (offload), which keep their step counts differently. A
# CPU Adam engine costs ~1.2 s to build here (the CPU probed once: cpu_probed_once), at every rank:
# ZeRO-2 with offload (dropped) took no resharding path these do not.
STRATEGIES = {
    "zero0": {"zero_stage": 0},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero3-offload": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
}
GLOBAL_BATCH = 8  # the same rows each step at every world size


def engine_at(strategy: dict, model_dir: Path, world_size: int):
    import deepspeed
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)  # the new classifier head, alike on every rank
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    cfg = TrainConfig(batch_size=GLOBAL_BATCH, learning_rate=1e-2, **strategy)
    plan = Plan(
        workers=world_size,
        cpus_per_worker=1,
        micro_batch=GLOBAL_BATCH // world_size,
        accumulation=1,
        use_gpu=False,
        precision="fp32",
    )
    config = deepspeed_config(cfg, plan, total_steps=10, hidden_size=model.config.hidden_size)
    return deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)[0]


def train_step(engine, step: int) -> None:
    """One optimizer step on this rank's part of a global batch drawn from the step alone."""
    rows = torch.Generator().manual_seed(step)
    input_ids = torch.randint(5, 100, (GLOBAL_BATCH, 12), generator=rows)
    labels = torch.randint(0, 2, (GLOBAL_BATCH,), generator=rows)
    micro = engine.train_micro_batch_size_per_gpu()
    mine = slice(engine.global_rank * micro, (engine.global_rank + 1) * micro)
    engine.backward(engine(input_ids=input_ids[mine], labels=labels[mine]).loss)
    engine.step()


def base_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps torch's (or CPU) Adam


def full_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole fp32 weight and Adam moments, gathered from wherever they are partitioned
    (a collective at ZeRO 1-3: every rank calls it), with each parameter group's hyperparameters."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if engine.zero_optimization_stage() in (1, 2):
        # DeepSpeed 0.19.8 links each parameter to its slice of Adam's state after the first group's first
        # step, before the second group has any state: its slices stay empty. Linked again, now.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    whole = engine.zero_optimization_stage() == 0  # ZeRO-0 holds them as they are: copies, which the next step leaves
    state = {}
    for name, param in engine.module.named_parameters():
        state[f"{name}.fp32"] = param.detach().clone() if whole else safe_get_full_fp32_param(param)
        for key in ("exp_avg", "exp_avg_sq"):
            kept = engine.optimizer.state[param][key].clone() if whole else safe_get_full_optimizer_state(param, key)
            state[f"{name}.{key}"] = kept
    for i, group in enumerate(base_optimizer(engine).param_groups):
        state[f"group{i}"] = torch.tensor([group["lr"], group["weight_decay"], *group["betas"]], dtype=torch.float64)
    return state


def steps_taken(engine) -> set[int]:
    """The step count each of the optimizer's states holds (its bias correction's)."""
    return {int(kept["step"]) for kept in base_optimizer(engine).state.values()}


def world(rank: int, size: int, port: int, model_dir: Path, root: Path, save: bool) -> None:
    """A rank of one process group: each strategy's engine two steps in and saved (save), or built and
    restored from the saved checkpoint; rank 0 writes each one's gathered state, then its step counts
    after one more step."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size)}
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank)}  # one machine
    torch.set_num_threads(1)
    join_process_group(torch.device("cpu"), timeout_s=600)
    cpu_probed_once()  # as a training worker does before its engine
    for name, strategy in STRATEGIES.items():
        engine = engine_at(strategy, model_dir, size)
        if save:
            for step in (1, 2):
                train_step(engine, step)
            engine.save_checkpoint(root / name, tag=TAG)
        else:
            restore(engine, str(root / name))
        state = full_state(engine)
        train_step(engine, 3)
        if rank == 0:
            torch.save({"state": state, "steps": steps_taken(engine)}, root / f"{name}-at-{size}.pt")


def started_world(size: int, port: int, model_dir: Path, root: Path, save: bool = False):
    return torch.multiprocessing.start_processes(
        world, args=(size, port, model_dir, root, save), nprocs=size, join=False, start_method="spawn"
    )


def distinct_ports(count: int) -> list[int]:
    ports = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def joined(world_started) -> None:
    while not world_started.join():
        pass


def test_a_checkpoint_of_2_workers_resumes_at_1_and_at_4_with_its_optimizer_moments(tiny_model, tmp_path):
    """Every fp32 weight, Adam moment and group hyperparameter as saved, bit for bit, and the next step
    is each optimizer state's third: DeepSpeed's ZeRO-3 universal load alone gives the no-decay group
    the decay, and counts a step per sub-group."""
    joined(started_world(2, free_port(), tiny_model, tmp_path, save=True))
    # The two resumptions side by side, each its own process group: one process alone left a core of two idle.
    resumed = [
        started_world(size, port, tiny_model, tmp_path) for size, port in zip((1, 4), distinct_ports(2), strict=True)
    ]
    for started in resumed:
        joined(started)
    for name in STRATEGIES:
        saved = torch.load(tmp_path / f"{name}-at-2.pt")
        for size in (1, 4):
            resumed = torch.load(tmp_path / f"{name}-at-{size}.pt")
            assert resumed["state"].keys() == saved["state"].keys()
            differ = [key for key, value in saved["state"].items() if not torch.equal(value, resumed["state"][key])]
            assert not differ, f"{name} at {size} worker(s): {differ[:5]}"
            assert resumed["steps"] == saved["steps"] == {3}, f"{name} at {size} worker(s)"


def test_a_checkpoint_goes_on_at_another_world_size_unless_tensor_or_pipeline_parallel():
    """A data-parallel checkpoint goes on at any number of workers, mid-epoch too (its epoch's trained rows
    are kept beside it: tasks/train/passes.py); a tensor-parallel run's is not re-partitioned, nor is a
    pipeline's. A checkpoint from before ftflow recorded its world size goes on anywhere."""
    mid_epoch, plain = Progress(step=135, epoch=1, rows_done=7 * 32, world_size=2), TrainConfig()
    assert resume_refused(mid_epoch, 2, plain) is None
    assert resume_refused(mid_epoch, 4, plain) is None
    assert resume_refused(mid_epoch, 4, TrainConfig(tensor_parallel_size=2)) == (
        "the checkpoint at step 135 was taken by 2 worker(s), and this run has 4: a tensor_parallel_size=2 run "
        "resumes with num_workers=2"
    )
    assert resume_refused(mid_epoch, 1, TrainConfig(pipeline_parallel_size=2)).endswith(
        "a pipeline_parallel_size=2 run resumes with num_workers=2"
    )
    assert resume_refused(mid_epoch.model_copy(update={"world_size": None}), 4, plain) is None
