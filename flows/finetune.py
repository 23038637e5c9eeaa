"""The `finetune` flow: tokenize -> train -> evaluate -> batch inference, every artifact in storage."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext
from pydantic import BaseModel

from tasks.contracts.metrics import AnyMetrics
from tasks.contracts.sweep import SweepResult
from tasks.contracts.training import Result, TrainingJob
from tasks.core import cluster
from tasks.core.config import FinetuneParams
from tasks.core.layout import RunStore, refuse_overlap
from tasks.core.progress import RUN_DIR
from tasks.core.reaper import reap_on_exit
from tasks.evaluate.task import evaluate
from tasks.infer.task import predict_files, write_test_labels
from tasks.promote.task import promote
from tasks.report import DataRecord, Outputs, Results, Stopwatch, import_beside, publish_report, track, write_manifest
from tasks.tokenize import TokenizeKey, checked_key
from tasks.tokenize.task import tokenize
from tasks.train.task import check_training_plan, train
from tasks.validate import RunInputs, run_inputs


class RunSummary(BaseModel):
    """What a finetune run returns (the `ftflow run` command prints it): where the run is, how its model
    scored on the test split, and whether it became the champion."""

    run_id: str
    run_dir: str
    report: str
    test: dict[str, float]  # the task's scores on the test split (accuracy and macro_f1 for single_label)
    metrics: AnyMetrics
    promoted: bool


def new_run_id() -> str:
    """The flow run's own: when it was created and its id. A retry of the flow run (the UI's Retry, a
    deployment's `retries`, a crashed run re-submitted) continues in the same run folder, and its
    training resumes from the last checkpoint instead of step 0."""
    run = FlowRunContext.get().flow_run
    return f"{run.created:%Y%m%d-%H%M%S}-{str(run.id)[:8]}"


@flow(name="finetune")
def finetune(params: FinetuneParams = FinetuneParams()) -> RunSummary:
    """Fine-tune a Hugging Face classifier and label a corpus with it."""
    reap_on_exit()  # this process's Prefect server and local Ray end with it, even if it is killed
    took = Stopwatch(get_run_logger())
    store = RunStore(params.storage_root, params.run_id or new_run_id())
    ready = prepared(params, store, took)
    import_beside(params.storage_root)  # MLflow's, for track() at the end
    with took("train"):
        training = train.with_options(timeout_seconds=params.train.timeout_s)(ready.job, params.ray_address)
    return concluded(params, store, ready, Trained(result=training), took)


class Trained(BaseModel):
    """What the stages after training take from it: the Result (a sweep's best trial's), and the
    sweep's trials where it was one."""

    result: Result
    sweep: SweepResult | None = None


@dataclass(frozen=True)
class Prepared:
    """What training starts from: the run's checked inputs, its shards' key, and the training job."""

    inputs: RunInputs
    key: TokenizeKey
    job: TrainingJob


def prepared(params: FinetuneParams, store: RunStore, took: Stopwatch) -> Prepared:
    """Every check, then the tokenized splits (cached by content): what training starts from."""
    # Bad input stops here, before Ray (`ftflow run` checked it before Prefect started).
    inputs = run_inputs(params, store)
    key = checked_key(inputs.splits, params.model, params.storage_root)
    refuse_overlap([key.target], inputs.read(params))
    cluster.refuse_local_paths(
        {"storage_root": [params.storage_root], **inputs.by_field()}, params.storage_shared, params.ray_address
    )
    # The plan against the cluster, before tokenizing.
    check_training_plan(params.model, params.data.targets, params.train, params.ray_address)
    took.mark("cluster ready")
    took.logger.info("run %s in %s", store.run_id, store.base, extra={RUN_DIR: store.base})
    with took("tokenize"):
        tokenized = tokenize.with_options(refresh_cache=not key.shards_exist())(
            key, inputs.splits, params.model.name_or_path, params.ray_address
        )
    targets = inputs.splits["train"].targets
    job = TrainingJob(shards=tokenized, model=params.model, targets=targets, train=params.train, store=store)
    return Prepared(inputs, key, job)


def concluded(
    params: FinetuneParams, store: RunStore, ready: Prepared, trained: Trained, took: Stopwatch
) -> RunSummary:
    """After training: evaluate, the promotion gate, batch inference, then the report, the manifest
    and MLflow."""
    inputs, training = ready.inputs, trained.result
    with took("evaluate"):
        metrics = evaluate(store, inputs.splits, training)
    with took("promote"):
        promotion = promote(store, metrics, inputs.splits["test"], params.promotion, params.ray_address)
    with took("batch inference"):
        if inputs.labels_test_split:  # the rows training labelled for evaluation: no model to load again
            predictions = write_test_labels(
                training, inputs.splits["test"], store.model_dir, inputs.inference, store.predictions
            )
        else:
            predictions = predict_files.with_options(timeout_seconds=inputs.inference.timeout_s)(
                store.model_dir, inputs.inference, store.predictions, params.ray_address
            )
    if trained.sweep is None:  # a sweep's trials each paid their own
        took.fixed_costs(training.marks)
    config = params.model_dump(mode="json")
    outputs = Outputs(
        tokenized=ready.job.shards,
        checkpoints=store.train_dir,
        model=store.model_dir,
        adapter=store.adapter_dir if params.train.lora else None,
        metrics=store.metrics,
        predictions=predictions,
        report=store.report,
        manifest=store.manifest,
    )
    results = Results(test=metrics, training=training, promotion=promotion, sweep=trained.sweep)
    publish_report(store, config, inputs.splits, outputs, results, took.seconds)
    write_manifest(
        store.manifest,
        config=config,
        data=DataRecord.of(inputs.splits, ready.key, ready.job.shards),
        outputs=outputs,
        results=results,
        seconds=took.seconds,
    )
    track(params, store, results, took.seconds)  # to MLflow; a warning, never a failure, when it cannot
    return RunSummary(
        run_id=store.run_id,
        run_dir=store.base,
        report=store.report_md,
        test=metrics.scores(),
        metrics=metrics,
        promoted=promotion.promoted,
    )
