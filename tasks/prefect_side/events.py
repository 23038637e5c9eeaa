"""ftflow's Prefect events: what deployments (deployments/definitions.py) are triggered by.

    ftflow.model.promoted   a run's model became its registry entry's champion (tasks/promote/task.py):
                            resource ftflow.model.<name>; payload model_uri, metric, score, run_id, storage_root,
                            labels_uri (where its on-promotion labelling goes)
    ftflow.data.arrived     new training data is there (`ftflow new-data URI`, or any emitter of the event):
                            resource ftflow.data.<name>; payload train_uri

Prefect's events are the wire: an automation (a deployment's trigger) starts a run with parameters
taken from the event, on the server that received it.
"""

from __future__ import annotations

from prefect.events import Event, emit_event

PROMOTED = "ftflow.model.promoted"
DATA_ARRIVED = "ftflow.data.arrived"


def promoted(
    model_name: str, model_uri: str, metric: str, score: float, run_id: str, storage_root: str, labels_uri: str
) -> Event | None:
    return emit_event(
        PROMOTED,
        resource={"prefect.resource.id": f"ftflow.model.{model_name}", "ftflow.model_name": model_name},
        payload={
            "model_uri": model_uri,
            "metric": metric,
            "score": score,
            "run_id": run_id,
            "storage_root": storage_root,
            "labels_uri": labels_uri,
        },
    )


def data_arrived(train_uri: str, name: str = "training") -> Event | None:
    return emit_event(
        DATA_ARRIVED, resource={"prefect.resource.id": f"ftflow.data.{name}"}, payload={"train_uri": train_uri}
    )
