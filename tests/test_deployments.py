"""Deployment definitions: the schedule and parameters come from deployments/retrain.yaml, checked."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

import pytest
import yaml
from conftest import FTFLOW
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

from deployments.definitions import RETRAIN_CONFIG, deployments
from tasks.prefect_side.limits import TRAINING_TAG
from tasks.train.task import train


def test_retraining_is_scheduled_with_the_files_parameters():
    retrain, on_promotion, on_demand, sweep = deployments()
    config = yaml.safe_load(RETRAIN_CONFIG.read_text())
    assert (retrain.name, on_promotion.name, on_demand.name) == ("retrain", "on-promotion", "on-demand")
    assert (sweep.flow_name, sweep.name) == ("sweep", "on-demand") and not sweep.schedules
    schedule = retrain.schedules[0].schedule
    assert (schedule.cron, schedule.timezone) == (config["cron"], config["timezone"])
    assert retrain.parameters == {"params": config["parameters"]}, (
        "only what the file sets: the rest is filled where it runs"
    )
    assert not on_demand.schedules
    assert TRAINING_TAG in train.tags


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("parameters", "train", "epoch"), 3, "parameters.train: unknown parameter 'epoch': did you mean 'epochs'?"),
        (("parameters", "train", "zero_stage"), 5, "parameters.train.zero_stage: Input should be 0, 1, 2 or 3"),
        (("crom",), "0 3 * * 1", "unknown parameter 'crom': did you mean 'cron'?"),
    ],
)
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


def test_ftflow_deploy_registers_them_with_a_work_pool_and_their_triggers():
    """`ftflow deploy --pool` against the test server (its deployments, automations and limit removed after)."""
    pool, api = f"pool-{uuid.uuid4().hex[:8]}", PREFECT_API_URL.value()
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        try:
            run = subprocess.run(
                [FTFLOW, "deploy", "--pool", pool],
                env={**os.environ, "PREFECT_API_URL": api},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 0, run.stdout + run.stderr
            deployed = {
                name: client.read_deployment_by_name(name)
                for name in ("finetune/retrain", "batch_infer/on-promotion", "batch_infer/on-demand", "sweep/on-demand")
            }
            assert {deployment.work_pool_name for deployment in deployed.values()} == {pool}
            triggers = {
                automation.name: automation
                for deployment in deployed.values()
                for automation in client.read_resource_related_automations(f"prefect.deployment.{deployment.id}")
            }
            assert set(triggers) == {"new training data", "sentiment promoted"}
            assert client.read_concurrency_limit_by_tag(TRAINING_TAG).concurrency_limit == 1
        finally:
            for name in ("finetune/retrain", "batch_infer/on-promotion", "batch_infer/on-demand"):
                with contextlib.suppress(ObjectNotFound):
                    deployment = client.read_deployment_by_name(name)
                    client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
                    client.delete_deployment(deployment.id)
            with contextlib.suppress(ObjectNotFound):
                client.delete_concurrency_limit_by_tag(TRAINING_TAG)
            client.delete_work_pool(pool)
