"""The `sweep` flow: tokenize -> trials (Ray Tune over train.* fields) -> the best trial evaluated,
through the promotion gate, batch inference and the report, as `finetune` does with its one model."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.finetune import RunSummary, Trained, concluded, new_run_id, prepared
from tasks.core.layout import RunStore
from tasks.core.reaper import reap_on_exit
from tasks.core.sweep_config import SweepParams
from tasks.report import Stopwatch, import_beside
from tasks.sweep.task import same_search, sweep_trials


@flow(name="sweep")
def sweep(params: SweepParams = SweepParams()) -> RunSummary:  # noqa: B008 -- as finetune's default (pyproject)
    """Search train.* fields for the best validation metric, then carry the best trial's model on."""
    reap_on_exit()
    took = Stopwatch(get_run_logger())
    store = RunStore(params.storage_root, params.run_id or new_run_id())
    same_search(params, store)  # a re-run of this id: the search it started
    ready = prepared(params, store, took)
    import_beside(params.storage_root)
    with took("sweep"):
        trials = sweep_trials(ready.job, params.sweep, params.ray_address)
    return concluded(params, store, ready, Trained(result=trials.training, sweep=trials), took)
