"""ftflow's Prefect deployments, defined once: served by the local stack (deployments/serve.py) or
registered with a work pool for a cluster (`ftflow deploy`, flows/cli.py).

    finetune/retrain       on the schedule in retrain.yaml (cron, time zone), with its parameters
    batch_infer/on-demand  no schedule: runs are triggered from the UI, the CLI or the API

Training runs hold a Ray cluster's CPUs or GPUs for a long time, so the `train` task carries the
tag tasks.train.TRAINING_TAG and a Prefect concurrency limit of 1 on that tag (limit_concurrency)
queues a second training run until the first one's training is done. (Tokenization needs no limit
here: tasks.tokenize holds one per shard set itself, in every run, deployed or not.)
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError
from prefect.client.orchestration import get_client
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.schedules import Cron

from flows.batch_infer import batch_infer
from flows.finetune import finetune
from tasks.config import FinetuneParams, Strict, one_line
from tasks.train import TRAINING_TAG

RETRAIN_CONFIG = Path(__file__).with_name("retrain.yaml")


class RetrainFile(Strict):
    """retrain.yaml: a key it does not know is refused like any parameter's."""

    name: str
    cron: str
    timezone: str
    parameters: FinetuneParams = FinetuneParams()


def deployments(config_path: Path = RETRAIN_CONFIG) -> list[RunnerDeployment]:
    """Entry points by module path (flows.finetune.finetune): ftflow is installed wherever its flows
    run (the local venv, the image), so a worker imports them with no code download or image build.
    The file is checked now (a bad one fails before anything is served, in one line naming it); its
    parameters are kept as written: what it leaves out is filled in where the run executes, so no
    path of the machine that deployed leaks into a cluster's runs."""
    try:
        config = RetrainFile.model_validate(yaml.safe_load(config_path.read_text()))
    except ValidationError as error:
        raise ValueError(f"{config_path}: {one_line(error)}") from None
    return [
        finetune.to_deployment(
            name=config.name,
            schedule=Cron(config.cron, timezone=config.timezone),
            parameters={"params": config.parameters.model_dump(mode="json", exclude_unset=True)},
            tags=["training"],
            description=f"Scheduled retraining ({config.cron}, {config.timezone}); parameters from {config_path.name}.",
            entrypoint_type=EntrypointType.MODULE_PATH,
        ),
        batch_infer.to_deployment(name="on-demand", tags=["inference"], entrypoint_type=EntrypointType.MODULE_PATH,
                                  description="Label a corpus with a trained model, when asked."),
    ]


def limit_concurrency() -> None:
    """One training task at a time on the server's runs (creating the limit again updates it)."""
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=TRAINING_TAG, concurrency_limit=1)
