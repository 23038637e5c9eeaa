"""What promotion hands on: its Decision, and the model registry in storage, each entry's champion,
written by the promotion gate (tasks/promote/task.py) and read by batch inference.

    <root>/models/<name>/champion   JSON: the champion's model URI, its run, its score on the test split

Kept free of Prefect and Ray: `ftflow infer models/<name>@champion` resolves the name before
anything starts.
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from tasks.core import layout, storage
from tasks.core.targets import task_of

CHAMPION_REF = re.compile(r"^models/(?P<name>[^/]+)@champion$")


class Champion(BaseModel):
    """A registry entry's pointer record: the champion's model and its score at its promotion."""

    model_uri: str
    run_id: str
    metric: str
    value: float
    test_sha256: str | None = None  # the test split it scored on (absent in pointers of older runs)
    test_reading: dict | None = None  # how those bytes were read into rows
    promoted_at: str


def resolve(model_uri: str, root: str) -> str:
    """`models/<name>@champion` -> the champion's model URI under `root`; any other URI as it is."""
    match = CHAMPION_REF.match(model_uri)
    if not match:
        return model_uri
    pointer = layout.StorageRoot(root).champion(match["name"])
    if not storage.exists(pointer):
        raise ValueError(
            f"model_uri {model_uri}: the registry entry '{match['name']}' under {storage.normalize(root)} has no "
            f"champion yet (no {pointer}): a finetune run with promotion.model_name='{match['name']}' and this "
            "storage_root promotes one"
        )
    return Champion.model_validate(storage.read_json(pointer)).model_uri


def check_champion_task(root: str, model_name: str, task: str) -> None:
    """A registry entry's champion stays of one task: a run of another would be compared with a model
    that predicts something else. Read from the champion's config.json, before any cluster work."""
    pointer = layout.StorageRoot(root).champion(model_name)
    if not storage.exists(pointer):
        return
    model_uri = Champion.model_validate(storage.read_json(pointer)).model_uri
    config = storage.join(model_uri, "config.json")
    found = task_of(storage.read_json(config)) if storage.exists(config) else task
    if found != task:
        raise ValueError(
            f"promotion.model_name {model_name}: its champion {model_uri} is a {found} model, and data.task is "
            f"{task}: a registry entry's champion keeps its task; name another entry"
        )


class Decision(BaseModel):
    """The promotion gate's decision, with why."""

    promoted: bool
    reason: str
    floor: str  # the least score, in words
    model_name: str
    metric: str
    challenger: float
    champion: float | None  # the champion's score on this test split; None when there was none to beat
    previous_champion_uri: str | None
    pointer: str

    def verdict(self) -> str:
        """The decision in a few words (Markdown), for the log, the artifact and the report."""
        name = self.model_name
        return (
            f"promoted to champion of `{name}`" if self.promoted else f"not promoted: `{name}`'s champion is unchanged"
        )
