"""The training config: what it derives, and every combination it refuses before the cluster starts."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError
from transformers import BertConfig, DistilBertConfig, LlamaConfig

from tasks.core.cluster import Resources
from tasks.core.config import ModelConfig
from tasks.core.models import check_parallelism
from tasks.core.sweep_config import SweepParams
from tasks.core.train_config import TrainConfig
from tasks.train.deepspeed_json import deepspeed_config
from tasks.train.plan import plan_of

LAPTOP, GPU_NODE = Resources(cpus=2, gpus=0), Resources(cpus=16, gpus=2)
# KubeRay's shipped cluster at rest: a head that takes no work, a GPU group scaled to zero.
GPUS_ON_DEMAND = Resources(cpus=0, gpus=0, node_cpus=0, can_grow=True)


def test_defaults_fit_the_machine_with_no_accumulation():
    """One worker with every CPU on one machine (no all-reduce); one worker per CPU on several nodes."""
    p = plan_of(TrainConfig(), LAPTOP)
    assert (p.workers, p.cpus_per_worker, p.micro_batch, p.accumulation, p.use_gpu, p.precision) == (
        1,
        2,
        32,
        1,
        False,
        "fp32",
    )
    assert (
        p.describe(TrainConfig())
        == "1 CPU worker(s) of 2 CPU x micro-batch 32 x accumulation 1 = global batch 32, ZeRO-0, fp32"
    )
    assert (
        plan_of(TrainConfig(num_workers=2), LAPTOP).cpus_per_worker,
        plan_of(TrainConfig(cpus_per_worker=0.5), LAPTOP).workers,
    ) == (1, 4)
    two_nodes = plan_of(TrainConfig(), Resources(cpus=16, gpus=0, node_cpus=8))
    assert (two_nodes.workers, two_nodes.cpus_per_worker, two_nodes.micro_batch) == (16, 1, 2)


def test_accumulation_is_what_the_global_batch_leaves_over():
    cfg = TrainConfig(num_workers=1, micro_batch_size=8, batch_size=32)
    p = plan_of(cfg, LAPTOP)
    assert (p.micro_batch, p.accumulation) == (8, 4)
    ds = deepspeed_config(cfg, p, total_steps=100)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 10


def test_a_range_of_workers_is_planned_for_the_most_and_each_group_keeps_the_global_batch_or_the_nearest():
    cfg = TrainConfig(num_workers=(1, 4), cpus_per_worker=1, batch_size=32)
    plan = plan_of(cfg, Resources(cpus=8, gpus=0))
    assert plan.describe(cfg).startswith(
        "1-4 CPU worker(s) of 1 CPU x micro-batch 8 x accumulation 1 = global batch 32"
    )
    groups = {workers: (plan.at(workers, 32).accumulation, plan.at(workers, 32).global_batch) for workers in (1, 2, 3)}
    assert groups == {1: (4, 32), 2: (2, 32), 3: (1, 24)}  # 3 x 8 divides no accumulation into 32: 24 is nearest


def test_gpu_cluster_gets_one_worker_per_gpu_and_mixed_precision():
    p = plan_of(TrainConfig(), GPU_NODE)
    assert (p.workers, p.use_gpu, p.precision) == (2, True, "auto")


@pytest.mark.parametrize(
    ("cfg", "resources", "message"),
    [
        (  # the workers as the cluster has them: 2 CPUs at 1 per worker
            TrainConfig(batch_size=31, cpus_per_worker=1),
            LAPTOP,
            "batch_size=31 is not divisible by 2 workers x micro_batch_size=15; use a batch_size that is a multiple of 30",
        ),
        (
            TrainConfig(num_workers=4),
            LAPTOP,
            r"num_workers=4 but the Ray cluster fits 2 \(2 CPUs at 1 per worker\), and no autoscaler",
        ),
        (TrainConfig(device="gpu"), LAPTOP, "device=gpu but the Ray cluster has no GPU, and no autoscaler to add one"),
        (TrainConfig(precision="fp16"), LAPTOP, "precision=fp16 needs a GPU and this run trains on CPUs"),
        (TrainConfig(activation_offload=True), LAPTOP, "activation_offload moves GPU activations"),
        (TrainConfig(num_workers=3, batch_size=30), GPU_NODE, r"num_workers=3 but the Ray cluster fits 2 \(2 GPUs\)"),
    ],
)
def test_what_cannot_run_here_is_refused_with_what_to_change(cfg, resources, message):
    with pytest.raises(ValueError, match=message):
        plan_of(cfg, resources)


def test_a_cluster_that_grows_is_asked_for_what_the_config_says():
    """Requests, not limits read off the nodes up now: the autoscaler adds the nodes they need."""
    p = plan_of(TrainConfig(num_workers=4, device="gpu", batch_size=64), GPUS_ON_DEMAND)
    assert (p.workers, p.micro_batch, p.use_gpu, p.precision) == (4, 16, True, "auto")
    assert plan_of(TrainConfig(), GPUS_ON_DEMAND).workers == 1, "by default, what fits now (at least one)"
    assert GPUS_ON_DEMAND.inference_actors(3, use_gpu=True) == (3, 1.0, 1)
    assert GPUS_ON_DEMAND.inference_actors(2, use_gpu=False) == (2, 1.0, 0), (
        "CPU actors on nodes yet to come: one CPU each"
    )
    grown = Resources(cpus=8, gpus=0, node_cpus=3, can_grow=True)  # three 3-CPU nodes up, less Ray Data's CPU
    assert grown.inference_actors(2, use_gpu=False) == (2, 3.0, 0), "no larger than a node holds"
    assert LAPTOP.inference_actors(None, use_gpu=False) == (2, 1.0, 0), "a CPU each, reading and writing its own parts"
    with pytest.raises(ValueError, match="actors=3 but the Ray cluster fits 2"):
        LAPTOP.inference_actors(3, use_gpu=False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"offload_params": True, "zero_stage": 2}, "offload_params needs zero_stage=3"),
        ({"offload_optimizer": True, "zero_stage": 0}, "offload_optimizer needs zero_stage 1, 2 or 3"),
        ({"batch_size": 30, "micro_batch_size": 8}, "batch_size=30 is not a multiple of micro_batch_size=8"),
        # Given num_workers, the parameters alone decide these: refused as parameters, not by the plan.
        (
            {"batch_size": 20, "num_workers": 2, "micro_batch_size": 4},
            "batch_size=20 is not divisible by 2 workers x micro_batch_size=4; use a batch_size that is a multiple of 8",
        ),
        (
            {"num_workers": 3, "tensor_parallel_size": 2, "cpus_per_worker": 0.5},
            "num_workers=3 is not a multiple of tensor_parallel_size=2: the workers are groups of 2 that hold one copy of "
            "the model; use num_workers=2 or 4",
        ),
        ({"num_workers": (2, 1)}, r"num_workers=\[2, 1\]: a range is \[min, max\] with 1 <= min <= max"),
        (
            {"num_workers": (2, 4), "tensor_parallel_size": 2},
            r"num_workers=\[2, 4\] with tensor_parallel_size=2: a range grows and shrinks by single workers, not "
            "whole model-parallel groups; give a fixed num_workers",
        ),
        (
            {"pipeline_parallel_size": 2, "zero_stage": 2},
            "pipeline_parallel_size needs zero_stage 0 or 1 without offload",
        ),
        (
            {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
            "tensor_parallel_size and pipeline_parallel_size cannot both be above 1",
        ),
        # A raw override of what ftflow derives would change the engine, not ftflow's plan of it.
        (
            {"deepspeed": {"zero_optimization": {"stage": 3}}},
            "deepspeed.zero_optimization.stage is derived from zero_stage",
        ),
        ({"deepspeed": {"bf16": {"enabled": True}}}, "deepspeed.bf16.enabled is derived from precision: set precision"),
        ({"deepspeed": {"bf16": False}}, "deepspeed.bf16 is derived from precision"),
        ({"deepspeed": {"gradient_clipping": 0.5}}, "deepspeed.gradient_clipping is derived from max_grad_norm"),
    ],
)
def test_invalid_combinations_fail_as_parameters(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**fields)


def test_offload_uses_deepspeeds_cpu_adam_and_raw_overrides_win():
    cfg = TrainConfig(
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
        deepspeed={"zero_optimization": {"reduce_bucket_size": 1000}, "steps_per_print": 50},
    )
    ds = deepspeed_config(cfg, plan_of(cfg, LAPTOP), total_steps=10, hidden_size=384)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1000
    assert (
        zero["stage3_prefetch_bucket_size"] == int(0.9 * 384**2) and zero["stage3_param_persistence_threshold"] == 3840
    )
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert ds["optimizer"]["params"]["torch_adam"] is False
    assert ds["steps_per_print"] == 50
    plain = deepspeed_config(TrainConfig(), plan_of(TrainConfig(), LAPTOP), total_steps=10)
    assert "offload_optimizer" not in plain["zero_optimization"] and plain["optimizer"]["params"]["torch_adam"] is True


def test_tensor_parallel_groups_take_the_workers_in_whole_groups():
    cfg = TrainConfig(tensor_parallel_size=2)
    p = plan_of(cfg, LAPTOP)
    assert (p.workers, p.cpus_per_worker, p.micro_batch) == (2, 1, 16), "one group of 2 on a laptop, sharing its CPUs"
    assert plan_of(cfg.model_copy(update={"batch_size": 48}), Resources(cpus=7, gpus=0, node_cpus=4)).workers == 6, (
        "of 7 that fit, 3 whole groups"
    )
    ds = deepspeed_config(cfg, p, total_steps=10)
    assert ds["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in ds
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * p.workers == cfg.batch_size


@pytest.mark.parametrize(
    ("model_config", "split", "message"),
    [
        (
            BertConfig(num_attention_heads=6, hidden_size=384),
            {"tensor_parallel_size": 4},
            "train.tensor_parallel_size=4 does not divide the model's num_attention_heads=6: use a divisor of 6",
        ),
        (
            BertConfig(num_attention_heads=4, hidden_size=64, intermediate_size=66),
            {"tensor_parallel_size": 4},
            "train.tensor_parallel_size=4 does not divide the model's intermediate_size=66",
        ),
        (
            DistilBertConfig(),
            {"tensor_parallel_size": 2},
            "is a 'distilbert' model, and tensor_parallel_size splits only bert, deberta-v2, .*: set it to 1",
        ),
        (
            LlamaConfig(num_attention_heads=4, num_key_value_heads=1),
            {"tensor_parallel_size": 2},
            "train.tensor_parallel_size=2 does not divide the model's num_key_value_heads=1: use a divisor of 1",
        ),
        (
            BertConfig(num_hidden_layers=3),
            {"pipeline_parallel_size": 2},
            "train.pipeline_parallel_size=2 does not divide the model's num_hidden_layers=3: use a divisor of 3",
        ),
    ],
)
def test_a_model_the_split_does_not_fit_is_refused_before_the_cluster(model_config, split, message, tmp_path):
    model_config.save_pretrained(tmp_path)  # the config is all the check reads
    (tmp_path / "model.safetensors").touch()  # and a folder without weights is no model (tasks/core/models.py)
    with pytest.raises(ValueError, match=message):
        check_parallelism(TrainConfig(**split), ModelConfig(name_or_path=str(tmp_path)), "single_label")


def test_strategy_auto_owns_what_it_chooses():
    with pytest.raises(
        ValidationError,
        match="strategy=auto chooses zero_stage, offload_optimizer, offload_params, tensor_parallel_size, pipeline_parallel_size, "
        "and zero_stage=3 was set too: leave it out, or set strategy=manual",
    ):
        TrainConfig(strategy="auto", zero_stage=3)
    with pytest.raises(ValidationError, match="memory_per_worker_gb is read by strategy=auto only"):
        TrainConfig(memory_per_worker_gb=4)
    form = TrainConfig(strategy="auto").model_dump()  # what the UI's form sends: every field, defaults included
    assert TrainConfig.model_validate(form).strategy == "auto"


def test_a_model_folder_given_relative_is_passed_on_absolute(tiny_model, monkeypatch):
    """Ray's workers run in folders of their own: there a relative path names nothing, and would be
    taken for a hub id; a hub id stays as it is."""
    monkeypatch.chdir(tiny_model.parent)
    assert ModelConfig(name_or_path=tiny_model.name).name_or_path == str(tiny_model)
    assert ModelConfig(name_or_path="bert-base-uncased").name_or_path == "bert-base-uncased"


def test_a_sweeps_choices_are_the_values_the_field_holds():
    """YAML reads 1e-4 as the string "1e-4": the search draws the number TrainConfig takes, so the
    trials' table and plot get numbers (a string among them broke the report's plot)."""
    choice = yaml.safe_load("{choice: [1e-4, 0.05]}")
    assert choice["choice"][0] == "1e-4"
    searched = SweepParams.model_validate({"sweep": {"space": {"train.learning_rate": choice}}})
    assert searched.sweep.fields()["learning_rate"].choice == [1e-4, 0.05]
