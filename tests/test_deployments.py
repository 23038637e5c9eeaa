"""Deployment definitions: the schedule and parameters come from deployments/retrain.yaml, checked."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from deployments.definitions import RETRAIN_CONFIG, deployments
from tasks.tokenize import TOKENIZE_TAG, tokenize
from tasks.train import TRAINING_TAG, train


def test_retraining_is_scheduled_with_the_files_parameters():
    retrain, on_demand = deployments()
    config = yaml.safe_load(RETRAIN_CONFIG.read_text())
    assert (retrain.name, on_demand.name) == ("retrain", "on-demand")
    schedule = retrain.schedules[0].schedule
    assert (schedule.cron, schedule.timezone) == (config["cron"], config["timezone"])
    assert retrain.parameters == {"params": config["parameters"]}, "only what the file sets: the rest is filled where it runs"
    assert not on_demand.schedules
    assert TRAINING_TAG in train.tags and TOKENIZE_TAG in tokenize.tags


def test_a_bad_parameter_in_the_file_is_refused_before_serving(tmp_path):
    config = yaml.safe_load(RETRAIN_CONFIG.read_text())
    config["parameters"]["train"]["zero_stage"] = 5
    bad = tmp_path / "retrain.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(ValidationError, match="train.zero_stage"):
        deployments(bad)
