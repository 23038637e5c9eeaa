"""Stage 3b: the promotion gate, and the model registry it keeps in storage.

    <root>/models/<name>/champion   JSON: the champion's model URI, its run, its score on the test split

A new model is compared with the current champion on the same test split: the champion's score
recorded at its promotion when that was on the same rows, else the champion scored again on the
split this run evaluated, so a changed split favours neither. It is promoted only when
its metric is at least the champion's plus the margin, by replacing the pointer in one write
(readers see the old champion or the new one, never a mix). A model that loses leaves the pointer
untouched, and the decision says why.

The write is a compare-and-swap against the pointer as it was read (storage.swap_json): of two runs
that compared with the same champion at once, exactly one replaces it; the other is not promoted and
says which run's model became champion meanwhile (its next run compares with that one).
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime, timezone

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks import events, jobs, storage
from tasks.config import PromotionConfig
from tasks.data import Split
from tasks.evaluate import score
from tasks.retries import RETRY_TRANSIENT

CHAMPION_REF = re.compile(r"^models/(?P<name>[^/]+)@champion$")


def champion_pointer(root: str, name: str) -> str:
    return storage.join(storage.normalize(root), "models", storage.safe_name(name, "model name"), "champion")


def resolve(model_uri: str, root: str) -> str:
    """`models/<name>@champion` -> the champion's model URI under `root`; any other URI as it is."""
    match = CHAMPION_REF.match(model_uri)
    if not match:
        return model_uri
    pointer = champion_pointer(root, match["name"])
    if not storage.exists(pointer):
        raise ValueError(f"{model_uri}: no champion at {pointer} (a finetune run with promotion.model_name="
                         f"'{match['name']}' and storage_root='{root}' promotes one)")
    return storage.read_json(pointer)["model_uri"]


def reading(split: Split) -> dict:
    """How the split's bytes were read into rows (format, columns, label names), as JSON holds it."""
    return json.loads(json.dumps(dataclasses.asdict(split.schema)))


def champions_score(current: dict, test: Split, metric: str, ray_address: str | None) -> float:
    """The champion's metric on this test split: as recorded at its promotion when that was on these
    very rows (same bytes, read the same way; the main job's re-score took 4.4 s of model start and
    prediction), else scored again."""
    if (current.get("test_sha256"), current.get("test_reading"), current["metric"]) == (test.sha256, reading(test), metric):
        return current["value"]
    return jobs.run(score, ray_address, get_run_logger(), model_uri=current["model_uri"], test=test)[metric]


@task(**RETRY_TRANSIENT)
def promote(model_uri: str, metrics: dict, test: Split, cfg: PromotionConfig, root: str, run_id: str,
            ray_address: str | None = None) -> dict:
    """Make model_uri the champion of cfg.model_name if it is at least as good; the decision, with why."""
    pointer = champion_pointer(root, cfg.model_name)
    current, version = storage.read_versioned_json(pointer)
    challenger = metrics[cfg.metric]
    if current is None:
        champion, promoted, why = None, True, "no champion yet"
    else:
        champion = champions_score(current, test, cfg.metric, ray_address)
        promoted = challenger >= champion + cfg.margin
        why = (f"{cfg.metric} {challenger:.4f} {'>=' if promoted else '<'} the champion's {champion:.4f} "
               f"+ margin {cfg.margin:g}, on the same test split")
    record = {"model_uri": model_uri, "run_id": run_id, "metric": cfg.metric, "value": challenger, "test_sha256": test.sha256,
              "test_reading": reading(test), "promoted_at": datetime.now(timezone.utc).isoformat()}
    verdict = f"promoted to champion of `{cfg.model_name}`" if promoted else f"not promoted: `{cfg.model_name}`'s champion stays"
    if promoted and not storage.swap_json(pointer, version, record):
        winner = storage.read_json(pointer)
        promoted, verdict = False, f"not promoted: another run's model became `{cfg.model_name}`'s champion first"
        why = (f"{why}, but while this run compared, run {winner['run_id']} made {winner['model_uri']} the champion "
               f"({winner['metric']} {winner['value']:.4f}); the next run compares with it")
    if promoted:  # for what a promotion triggers (deployments/definitions.py): labelling with the new champion
        events.promoted(cfg.model_name, model_uri, cfg.metric, challenger, run_id, root)
    decision = {"promoted": promoted, "reason": why, "model_name": cfg.model_name, "metric": cfg.metric,
                "challenger": challenger, "champion": champion, "previous_champion_uri": current and current["model_uri"],
                "pointer": pointer}
    get_run_logger().info("%s (%s)", verdict.replace("`", ""), why)
    create_markdown_artifact(key="promotion", markdown=f"### {model_uri}\n\n{verdict} ({why}).\n\nPointer: `{pointer}`\n",
                             description="The promotion gate's decision")
    return decision
