"""Stage 3b: the promotion gate, writing the registry's champion pointer (tasks/contracts/promotion.py).

A model is promoted only above a floor: by default, better than a model that learned nothing
(evaluation's floor: always predicting the test split's majority class, giving each label as most
training rows have it, predicting the training mean), else promotion.min_score. Then it
is compared with the current champion on the same test split: the champion's score recorded at its
promotion when that was on the same rows, else the champion scored again on the split this run
evaluated, so a changed split favours neither. It is promoted only when its metric is at least the
champion's plus the margin, by replacing the pointer in one write (readers see the old champion or
the new one, never a mix). A model that loses leaves the pointer untouched, and the decision says why.

The write is a compare-and-swap against the pointer as it was read (storage.swap_json): of two runs
that compared with the same champion at once, exactly one replaces it; the other is not promoted and
says which run's model became champion meanwhile (its next run compares with that one).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.contracts.metrics import AnyMetrics
from tasks.contracts.promotion import Champion, Decision
from tasks.core import jobs, layout, storage
from tasks.core.config import InferenceConfig, PromotionConfig
from tasks.core.data import Split
from tasks.core.layout import RunStore
from tasks.prefect_side import events
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.promote.rescore import score


def reading(split: Split) -> dict:
    """How the split's bytes were read into rows (format, columns, label names), as JSON holds it."""
    return json.loads(json.dumps(dataclasses.asdict(split.schema)))


def champions_score(current: Champion, test: Split, metric: str, ray_address: str | None) -> float:
    """The champion's metric on this test split: as recorded at its promotion when that was on these
    very rows (same bytes, read the same way; the main job's re-score took 4.4 s of model start and
    prediction), else scored again."""
    if (current.test_sha256, current.test_reading, current.metric) == (test.sha256, reading(test), metric):
        return current.value
    # The default batch size: it sets the speed, not the labels.
    batch_size = InferenceConfig().batch_size
    scored = jobs.run(
        score, ray_address, get_run_logger(), model_uri=current.model_uri, test=test, batch_size=batch_size
    )
    return scored.scores()[metric]


def floor(metrics: AnyMetrics, cfg: PromotionConfig) -> tuple[float, bool, str]:
    """(the least score, whether reaching it is enough, the floor in words): promotion.min_score, or
    the score of a model that learned nothing (evaluation's floor), which a model must beat."""
    at_least = "<=" if cfg.lower_is_better else ">="
    if cfg.min_score is not None:
        return cfg.min_score, True, f"{cfg.metric} {at_least} {cfg.min_score:.4f} (promotion.min_score)"
    least = metrics.floor.scores[cfg.metric]
    return (
        least,
        False,
        f"{cfg.metric} {at_least[0]} {least:.4f}, the score of {metrics.floor.words} (promotion.min_score unset)",
    )


def better(cfg: PromotionConfig, score: float, than: float) -> bool:
    """Whether `score` is at least `than` by the metric's direction (higher, or lower for mse and mae)."""
    return score <= than if cfg.lower_is_better else score >= than


@task(**RETRY_TRANSIENT)
def promote(
    store: RunStore, metrics: AnyMetrics, test: Split, cfg: PromotionConfig, ray_address: str | None = None
) -> Decision:
    """Make the run's model the champion of cfg.model_name if it clears the floor and is at least as
    good as the champion on the test split."""
    cfg = cfg.of_task(metrics.task)
    pointer = layout.StorageRoot(store.root).champion(cfg.model_name)
    record, version = storage.read_versioned_json(pointer)
    current = Champion.model_validate(record) if record is not None else None
    challenger, the_floor = metrics.scores()[cfg.metric], floor(metrics, cfg)
    promoted, why, champion = judged(challenger, the_floor, cfg, current, test, ray_address)
    if promoted:
        new = Champion(
            model_uri=store.model_dir,
            run_id=store.run_id,
            metric=cfg.metric,
            value=challenger,
            test_sha256=test.sha256,
            test_reading=reading(test),
            promoted_at=datetime.now(UTC).isoformat(),
        )
        promoted, why = claimed(pointer, version, new, why)
    decision = Decision(
        promoted=promoted,
        reason=why,
        floor=the_floor[2],
        model_name=cfg.model_name,
        metric=cfg.metric,
        challenger=challenger,
        champion=champion,
        previous_champion_uri=current.model_uri if current else None,
        pointer=pointer,
    )
    announced(decision, store)
    return decision


def judged(
    challenger: float,
    the_floor: tuple[float, bool, str],
    cfg: PromotionConfig,
    current: Champion | None,
    test: Split,
    ray_address: str | None,
) -> tuple[bool, str, float | None]:
    """Whether the challenger's score wins over the floor (`floor`'s) and the champion, why, and the
    champion's score on this test split (None: not scored)."""
    least, reaching_is_enough, floor_words = the_floor
    if not better(cfg, challenger, least) or (challenger == least and not reaching_is_enough):
        above = "below" if cfg.lower_is_better else "above"
        return False, f"{cfg.metric} {challenger:.4f} is not {above} the floor: {floor_words}", None
    if current is None:
        return True, "no champion yet", None
    champion, sign = champions_score(current, test, cfg.metric, ray_address), -1 if cfg.lower_is_better else 1
    promoted = better(cfg, challenger, champion + sign * cfg.margin)
    compared = ("<=" if promoted else ">") if sign < 0 else (">=" if promoted else "<")
    why = (
        f"{cfg.metric} {challenger:.4f} {compared} the champion's {champion:.4f} "
        f"{'-' if sign < 0 else '+'} margin {cfg.margin:g}, on the same test split"
    )
    return promoted, why, champion


def claimed(pointer: str, version: str | None, new: Champion, why: str) -> tuple[bool, str]:
    """The pointer swapped to the new champion, if no other run moved it since it was read."""
    if storage.swap_json(pointer, version, new.model_dump(mode="json")):
        return True, why
    winner = Champion.model_validate(storage.read_json(pointer))
    return False, (
        f"{why}, but while this run compared, run {winner.run_id} made {winner.model_uri} the champion "
        f"({winner.metric} {winner.value:.4f}); the next run compares with it"
    )


def announced(decision: Decision, store: RunStore) -> None:
    """The decision in the run's log and its Prefect artifact; a promotion as the event that triggers
    labelling with the new champion (deployments/definitions.py)."""
    name, why = decision.model_name, decision.reason
    if decision.promoted:
        labels = layout.StorageRoot(store.root).labels(name, store.run_id)
        events.promoted(name, store.model_dir, decision.metric, decision.challenger, store.run_id, store.root, labels)
    get_run_logger().info("%s (%s)", decision.verdict().replace("`", ""), why)
    create_markdown_artifact(
        key="promotion",
        markdown=f"### {store.model_dir}\n\n{decision.verdict()} ({why}).\n\nFloor: {decision.floor}.\n\n"
        f"Pointer: `{decision.pointer}`\n",
        description="The promotion gate's decision",
    )
