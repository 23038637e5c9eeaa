"""The checkpoint policy's decisions on a validation curve (tasks/train/checkpoints.py), as a resumed
run makes them from the curve its checkpoint holds; the exported model's precision."""

from __future__ import annotations

import pytest
import torch

from tasks.contracts.training import SCORE, UNVALIDATED, Curve, Point
from tasks.core.train_config import TrainConfig
from tasks.train.checkpoints import CheckpointPolicy, export_dtype


def curve_of(accuracies: list[float]) -> Curve:
    validation = [
        Point(step=10 * (i + 1), epoch=0.1 * (i + 1), loss=1 - a, accuracy=a) for i, a in enumerate(accuracies)
    ]
    return Curve(validation=validation)


def test_validation_and_checkpoints_fall_on_the_configured_steps_but_not_the_epochs_last():
    policy = CheckpointPolicy(TrainConfig(eval_every_steps=10, checkpoint_every_steps=20, keep_best=False))
    assert [step for step in range(1, 41) if policy.validates(step, last=False)] == [10, 20, 30, 40]
    assert not policy.validates(20, last=True), "the epoch's end validates on its own"
    flat = curve_of([0.5])
    assert [step for step in range(1, 41) if policy.checkpoints(step, False, False, flat)] == [20, 40]


def test_keep_best_checkpoints_every_validation_that_beats_all_before_it():
    policy = CheckpointPolicy(TrainConfig(eval_every_steps=10, checkpoint_every_steps=0, keep_best=True))
    assert policy.checkpoints(30, False, True, curve_of([0.5, 0.6, 0.7]))
    assert not policy.checkpoints(30, False, True, curve_of([0.5, 0.7, 0.6])), "not better than step 20"
    assert not policy.checkpoints(30, False, False, curve_of([0.5, 0.6, 0.7])), "not validated at this step"


def test_early_stopping_counts_evaluations_since_the_best_and_says_why():
    policy = CheckpointPolicy(TrainConfig(eval_every_steps=10, early_stopping_patience=2))
    assert not policy.patience_spent(curve_of([0.5, 0.7, 0.6]))
    spent = curve_of([0.5, 0.7, 0.6, 0.7])  # an equal is not better
    assert policy.patience_spent(spent)
    assert policy.stop_reason(spent, 40) == (
        "early stopping at step 40: no better val_accuracy in 2 evaluation(s) than step 20's 0.7000"
    )
    assert CheckpointPolicy(TrainConfig(max_steps=40)).stop_reason(spent, 40) == "max_steps=40"


def test_a_report_ranks_a_validated_step_by_its_score_and_any_other_below_all():
    policy, curve = CheckpointPolicy(TrainConfig()), curve_of([0.5, 0.75])
    validated = policy.reported(curve, 20, 0.2, validated=True)
    assert validated[SCORE] == 0.75 and validated["val_accuracy"] == 0.75 and validated["evaluations"] == 2
    assert policy.reported(curve, 25, 0.25, validated=False)[SCORE] == UNVALIDATED


@pytest.mark.parametrize(
    ("setting", "trained_in", "params", "exported"),
    [
        ("auto", "bf16", 10**8, torch.float32),  # loads in fp32 by default, as CPUs serve it best
        ("auto", "bf16", 8 * 10**9, torch.bfloat16),  # half the disk and host memory
        ("auto", "fp16", 10**9, torch.float16),
        ("auto", "fp32", 8 * 10**9, torch.float32),  # nothing to halve without rounding
        ("fp32", "bf16", 8 * 10**9, torch.float32),
        ("bf16", "fp32", 10**8, torch.bfloat16),
    ],
)
def test_the_export_is_fp32_below_a_billion_parameters_else_as_trained_unless_asked(
    setting, trained_in, params, exported
):
    assert export_dtype(setting, trained_in, params) == exported
