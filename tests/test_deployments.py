"""Deployment definitions: the schedule and parameters come from deployments/retrain.yaml, checked."""

from __future__ import annotations

import pytest
import yaml

from deployments.definitions import RETRAIN_CONFIG, deployments
from tasks.train import TRAINING_TAG, train


def test_retraining_is_scheduled_with_the_files_parameters():
    retrain, on_promotion, on_demand = deployments()
    config = yaml.safe_load(RETRAIN_CONFIG.read_text())
    assert (retrain.name, on_promotion.name, on_demand.name) == ("retrain", "on-promotion", "on-demand")
    schedule = retrain.schedules[0].schedule
    assert (schedule.cron, schedule.timezone) == (config["cron"], config["timezone"])
    assert retrain.parameters == {"params": config["parameters"]}, "only what the file sets: the rest is filled where it runs"
    assert not on_demand.schedules
    assert TRAINING_TAG in train.tags


@pytest.mark.parametrize("path, value, message", [
    (("parameters", "train", "epoch"), 3, "parameters.train: unknown parameter 'epoch': did you mean 'epochs'?"),
    (("parameters", "train", "zero_stage"), 5, "parameters.train.zero_stage: Input should be 0, 1, 2 or 3"),
    (("crom",), "0 3 * * 1", "unknown parameter 'crom': did you mean 'cron'?"),
])
def test_a_bad_key_or_value_in_the_file_is_refused_before_serving_in_one_line(tmp_path, path, value, message):
    config = yaml.safe_load(RETRAIN_CONFIG.read_text())
    *parents, key = path
    section = config
    for parent in parents:
        section = section[parent]
    section[key] = value
    bad = tmp_path / "retrain.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError) as refused:
        deployments(bad)
    assert str(refused.value) == f"{bad}: {message}"
