"""ftflow's Prefect deployments, defined once: served by the local stack (deployments/serve.py) or
registered with a work pool for a cluster (`ftflow deploy`, ftflow/cli.py).

    finetune/retrain          on the schedule in retrain.yaml (cron, time zone), with its parameters; and
                              on a "new data" event (tasks/prefect_side/events.py), training on the event's train_uri
    batch_infer/on-promotion  on a promotion event of relabel.yaml's registry entry: its corpus labelled
                              with the new champion, into <storage_root>/labels/<entry>/<run id>/
    batch_infer/on-demand     no schedule: runs are triggered from the UI, the CLI or the API
    sweep/on-demand           no schedule: a search over train.* fields, from the UI's form, the CLI or the API

Training runs hold a Ray cluster's CPUs or GPUs for a long time, so the `train` task carries the
tag tasks.prefect_side.limits.TRAINING_TAG (the sweep's trials too) and a Prefect concurrency limit of 1 on that tag (limit_concurrency)
queues a second training run until the first one's training is done. (Tokenization needs no limit
here: tasks.tokenize holds one per shard set itself, in every run, deployed or not.)
"""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron
from pydantic import ValidationError

from flows.batch_infer import batch_infer
from flows.finetune import finetune
from flows.sweep import sweep
from tasks.core.config import BatchInferParams, FinetuneParams, SafeName
from tasks.core.strict import Strict, one_line
from tasks.prefect_side.events import DATA_ARRIVED, PROMOTED
from tasks.prefect_side.limits import TRAINING_TAG

RETRAIN_CONFIG = Path(__file__).with_name("retrain.yaml")
RELABEL_CONFIG = Path(__file__).with_name("relabel.yaml")


class RetrainFile(Strict):
    """retrain.yaml: a key it does not know is refused like any parameter's."""

    name: str
    cron: str
    timezone: str
    parameters: FinetuneParams = FinetuneParams()


class RelabelFile(Strict):
    """relabel.yaml: what a new champion labels."""

    name: str
    model_name: SafeName
    input_uri: str | list[str]
    parameters: dict = {}  # batch_infer's others (batch_size, actors, ...), checked as BatchInferParams below


def read(model: type[Strict], path: Path) -> Strict:
    try:
        return model.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as error:
        raise ValueError(f"{path}: {one_line(error)}") from None


def deployments(config_path: Path = RETRAIN_CONFIG, relabel_path: Path = RELABEL_CONFIG) -> list[RunnerDeployment]:
    """Entry points by module path (flows.finetune.finetune): ftflow is installed wherever its flows
    run (the local venv, the image), so a worker imports them with no code download or image build.
    The file is checked now (a bad one fails before anything is served, in one line naming it); its
    parameters are kept as written: what it leaves out is filled in where the run executes, so no
    path of the machine that deployed leaks into a cluster's runs."""
    config, relabel = read(RetrainFile, config_path), read(RelabelFile, relabel_path)
    params = config.parameters.model_dump(mode="json", exclude_unset=True)
    on_new_data = {**params, "data": {**params.get("data", {}), "train_uri": "{{ event.payload.train_uri }}"}}
    return [
        finetune.to_deployment(
            name=config.name,
            schedule=Cron(config.cron, timezone=config.timezone),
            parameters={"params": params},
            triggers=[
                DeploymentEventTrigger(
                    name="new training data", expect={DATA_ARRIVED}, parameters={"params": on_new_data}
                )
            ],
            tags=["training"],
            description=f"Scheduled retraining ({config.cron}, {config.timezone}), and on new training data (event "
            f"{DATA_ARRIVED}: its train_uri); parameters from {config_path.name}.",
            entrypoint_type=EntrypointType.MODULE_PATH,
        ),
        relabelling(relabel, relabel_path),
        batch_infer.to_deployment(
            name="on-demand",
            tags=["inference"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="Label a corpus with a trained model, when asked.",
        ),
        sweep.to_deployment(
            name="on-demand",
            tags=["training"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="Search train.* fields with Ray Tune (its space, trials and scheduler in the form), then "
            "carry the best trial's model through evaluation, the promotion gate and batch inference.",
        ),
    ]


def relabelling(config: RelabelFile, path: Path) -> RunnerDeployment:
    """batch_infer on every promotion of config.model_name, with the event's model."""
    on_promotion = {
        "model_uri": "{{ event.payload.model_uri }}",
        "input_uri": config.input_uri,
        "output_uri": "{{ event.payload.labels_uri }}",
        **config.parameters,
    }
    try:
        BatchInferParams.model_validate(on_promotion)
    except ValidationError as error:
        raise ValueError(f"{path}: parameters: {one_line(error)}") from None
    return batch_infer.to_deployment(
        name=config.name,
        tags=["inference"],
        entrypoint_type=EntrypointType.MODULE_PATH,
        triggers=[
            DeploymentEventTrigger(
                name=f"{config.model_name} promoted",
                expect={PROMOTED},
                match={"prefect.resource.id": f"ftflow.model.{config.model_name}"},
                parameters={"params": on_promotion},
            )
        ],
        description=f"Label {config.input_uri} with each new champion of {config.model_name} (event {PROMOTED}); from {path.name}.",
    )


def limit_concurrency() -> None:
    """One training task at a time on the server's runs (creating the limit again updates it)."""
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=TRAINING_TAG, concurrency_limit=1)
