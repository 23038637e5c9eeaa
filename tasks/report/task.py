"""The run report: what a person reads after a finetune run, as Prefect artifacts (a markdown report
with its plots inline, a metrics table) and as files beside the run (<run>/report/report.md with
the same plots as PNG), so that it outlives the Prefect database and can be linked to."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.contracts.labels import Labelled
from tasks.contracts.metrics import AnyMetrics, details_markdown
from tasks.contracts.promotion import Decision
from tasks.contracts.shards import TokenizedSplits
from tasks.contracts.sweep import SweepResult
from tasks.contracts.training import Predictions, Result
from tasks.core import layout, storage
from tasks.core.data import Split, labelled_frames
from tasks.core.layout import RunStore
from tasks.core.tagging import OUTSIDE, entities
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.report.manifest import Outputs, Results, versions
from tasks.report.plots import PLOTS, TASK_SECTIONS, sweep_curves_plot, sweep_plot, task_plot, training_plot


def trial_rows(sweep: SweepResult) -> list[dict]:
    return [
        {
            "trial": f"**{trial.trial_id}**" if trial.trial_id == sweep.best_trial else trial.trial_id,
            **{f"train.{name}": sweep.shown(name, trial.config[name]) for name in sweep.fields},
            "status": trial.status,
            f"last {sweep.metric}": None if trial.last is None else round(trial.last, 4),
            f"best {sweep.metric}": None if trial.best is None else round(trial.best, 4),
            "steps": trial.step,
            "seconds": None if trial.seconds is None else round(trial.seconds, 1),
            "how it ended": trial.how,
        }
        for trial in sweep.trials
    ]


def sweep_lines(sweep: SweepResult, images: dict[str, str], stored: Callable[[str], str]) -> list[str]:
    best = sweep.best()
    return [
        "## Sweep",
        "",
        f"{len(sweep.trials)} trials; the best by {sweep.metric} ({sweep.direction}imized), trial **{best.trial_id}**, "
        "is the model evaluated, gated and used for inference below.",
        "",
        f"![best {sweep.metric} against the searched fields]({images['sweep']})",
        "",
        stored("sweep"),
        "",
        f"![each trial's {sweep.metric} at each evaluation]({images['sweep_curves']})",
        "",
        stored("sweep_curves"),
        "",
        *table(trial_rows(sweep)),
        "",
    ]


def link(uri: str, under: str = "") -> str:
    """A link to a stored file, named by its path below `under` when it is there (shorter tables)."""
    name = uri.removeprefix(f"{under}/") if under else uri
    return f"[`{name}`]({uri if storage.is_remote(uri) else 'file://' + uri})"


def task_lines(metrics: AnyMetrics, images: dict[str, str], plot_link) -> list[str]:
    name, title = TASK_SECTIONS[metrics.task]
    return [f"## {title}", "", f"![{title}]({images[name]})", "", plot_link(name), "", details_markdown(metrics), ""]


SENTENCES = 5  # test sentences a token classifier's report shows, with their entities marked


def marked(words: list[str], tags: list[int], names: tuple[str, ...]) -> str:
    """A sentence with its entities in bold, each followed by its type."""
    shown = [word.replace("|", "\\|") for word in words]
    for kind, first, last in entities([names[tag] for tag in tags]):
        shown[first] = f"**{shown[first]}"
        shown[last - 1] = f"{shown[last - 1]}** _({kind})_"
    return " ".join(shown)


def sentence_lines(test: Split, predictions: Predictions) -> list[str]:
    """The first test sentences with an entity, true or predicted: their true and predicted entities."""
    names, rows = test.schema.label_names, []
    outside = names.index(OUTSIDE)
    for frame in labelled_frames(test.uris[0], test.schema):
        for row, words in frame["text"].items():
            true, tags = predictions.gold[row], predictions.tags[row]
            if set(true) | set(tags) != {outside}:
                rows.append({"row": row, "true": marked(words, true, names), "predicted": marked(words, tags, names)})
        if len(rows) >= SENTENCES:
            break
    return ["## Test sentences", "", *table(rows[:SENTENCES]), ""]


def summary(metrics: AnyMetrics, promotion: Decision) -> list[str]:
    scores = ", ".join(f"{name.replace('_', ' ')} **{value:.4f}**" for name, value in metrics.scores().items())
    return [
        f"Test {scores} on {metrics.rows} rows.",
        "",
        f"Promotion: **{promotion.verdict()}** ({promotion.reason}).",
        "",
        f"Promotion floor: {promotion.floor}.",
        "",
    ]


def metric_rows(results: Results) -> list[dict]:
    last, metrics, promotion = results.training.history[-1], results.test, results.promotion
    rows = [("train", "loss", last.train_loss), ("validation", "loss", last.val_loss)]
    rows += [("validation", "accuracy", last.val_accuracy)] if last.val_accuracy is not None else []
    rows += [("validation", "entity_f1", last.val_entity_f1)] if last.val_entity_f1 is not None else []
    kept = results.training.kept
    if kept and kept.step != last.step:  # keep_best exported an earlier step than the last
        monitor = next(name for name in ("entity_f1", "accuracy", "loss") if getattr(kept.validation, name) is not None)
        rows.append(("validation", f"{monitor} at step {kept.step}, exported", getattr(kept.validation, monitor)))
    rows += [("test", name, value) for name, value in metrics.scores().items()]
    if promotion.champion is not None:
        rows.append(("test", f"champion {promotion.metric}", promotion.champion))
    return [{"split": split, "metric": name, "value": round(value, 4)} for split, name, value in rows]


def phase_lines(phases: dict[str, float]) -> list[str]:
    """The run's every second, phase by phase; none for a sweep, whose trials each had their own."""
    if not phases:
        return []
    return [
        "Every second of the run, from its process's start to the report, phase by phase:",
        "",
        *table([{"phase": phase, "seconds": s} for phase, s in phases.items()]),
        "",
    ]


def table(rows: list[dict]) -> list[str]:
    columns = list(rows[0])
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"] + [
        "| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows
    ]


def epoch_rows(training: Result) -> list[dict]:
    return [
        {
            "epoch": e.epoch,
            "step": e.step,
            "rows": e.rows if e.rows is not None else "",
            "train loss": round(e.train_loss, 4),
            "val loss": round(e.val_loss, 4),
            **({"val accuracy": round(e.val_accuracy, 4)} if e.val_accuracy is not None else {}),
            **({"val entity F1": round(e.val_entity_f1, 4)} if e.val_entity_f1 is not None else {}),
            "samples/s": round(e.samples_per_s, 1),
            "peak MiB per worker": round(e.peak_memory_mb),
            "workers": e.workers if e.workers is not None else "",
            "resumed from step": e.resumed_from_step or "",
        }
        for e in training.history
    ]


def group_lines(training: Result) -> list[str]:
    """The numbers of workers the run trained with, where it changed (a range of num_workers)."""
    if len(training.groups) < 2:
        return []
    turns = ", then ".join(f"{group.workers} from step {group.from_step}" for group in training.groups)
    return [f"Workers: {turns}.", ""]


def parameter_lines(training: Result) -> list[str]:
    """How many parameters the model has, and how many trained: fewer under LoRA."""
    if training.parameters is None:
        return []
    every, trained = training.parameters, training.trained_parameters or 0
    return [f"Parameters: {every:,}, of which {trained:,} trained ({trained / every:.1%}).", ""]


def data_rows(splits: dict[str, Split], tokenized: TokenizedSplits, root: str) -> list[dict]:
    """Each split's rows and files; a token classifier's windows too (a text longer than the model: several)."""
    windows = tokenized.rows() if splits["train"].schema.tagged else {}
    return [
        {
            "split": name,
            "rows": split.total_rows,
            **({"windows": windows[name]} if windows else {}),
            "MiB": round(sum(p.size for p in split.pieces) / 2**20, 2),
            "files": len(split.uris),
            "sha256": f"`{split.sha256[:12]}`",
            "tokenized": link(getattr(tokenized, name), root),
        }
        for name, split in splits.items()
    ]


def data_lines(splits: dict[str, Split], outputs: Outputs, root: str) -> list[str]:
    predictions = outputs.predictions
    return [
        "## Data",
        "",
        *table(data_rows(splits, outputs.tokenized, root)),
        "",
        f"Predictions: {predictions.rows} rows from {predictions.files} file(s).",
        "",
    ]


def stored(outputs: Outputs, results: Results) -> dict[str, str]:
    """Where each of the run's artifacts is."""
    return {
        "model": outputs.model,
        **({"LoRA adapter alone (peft)": outputs.adapter} if outputs.adapter else {}),
        "metrics": outputs.metrics,
        "predictions": outputs.predictions.output_uri,
        "training checkpoints": outputs.checkpoints,
        "report and plots": outputs.report,
        "manifest (config, versions, data hashes)": outputs.manifest,
        "champion pointer": results.promotion.pointer,
    }


def markdown(
    store: RunStore,
    config: dict,
    splits: dict[str, Split],
    outputs: Outputs,
    results: Results,
    seconds: dict,
    images: dict[str, str],
) -> str:
    """The report, with each plot at images[name]: a file beside it, or the PNG inline for the Prefect UI."""
    root = storage.normalize(store.root)

    def plot_link(name: str) -> str:
        return f"Stored as {link(storage.join(store.report, PLOTS[name]), root)}"

    lines = [
        f"# {'sweep' if results.sweep else 'finetune run'} `{store.run_id}`",
        "",
        f"Run folder: {link(store.base)}",
        "",
        *summary(results.test, results.promotion),
        *(sweep_lines(results.sweep, images, plot_link) if results.sweep else []),
        "## Metrics",
        "",
        *table(metric_rows(results)),
        "",
        "## Training",
        "",
        f"![loss and accuracy per step]({images['training']})",
        "",
        plot_link("training"),
        "",
        *table(epoch_rows(results.training)),
        "",
        *parameter_lines(results.training),
        *group_lines(results.training),
        *task_lines(results.test, images, plot_link),
        *(sentence_lines(splits["test"], results.training.test) if splits["test"].schema.tagged else []),
        *data_lines(splits, outputs, root),
        "## Timings",
        "",
        *table([{"stage": stage, "seconds": s} for stage, s in seconds.items() if stage != "phases"]),
        "",
        *phase_lines(seconds.get("phases", {})),
        "## Stored artifacts",
        "",
        *table([{"what": what, "where": link(uri, root)} for what, uri in stored(outputs, results).items()]),
        "",
        "## Configuration",
        "",
        "```json",
        json.dumps(config, indent=2),
        "```",
        "",
        "Versions: " + ", ".join(f"{name} {v}" for name, v in versions().items()),
        "",
    ]
    return "\n".join(lines)


@task(**RETRY_TRANSIENT)
def publish_report(
    store: RunStore, config: dict, splits: dict[str, Split], outputs: Outputs, results: Results, seconds: dict
) -> str:
    """report.md and its plots in the run's report folder, and the same report and a metrics table as Prefect artifacts."""
    plots = {"training": training_plot(results.training.curve), **task_plot(results, splits)}
    if results.sweep:
        plots["sweep"] = sweep_plot(results.sweep)
        plots["sweep_curves"] = sweep_curves_plot(results.sweep)
    for name, image in plots.items():
        storage.write_bytes(storage.join(store.report, PLOTS[name]), image)
    beside = markdown(store, config, splits, outputs, results, seconds, PLOTS)
    storage.write_bytes(store.report_md, beside.encode())
    # The Prefect UI cannot read the store (a local folder, a private bucket): its copy carries the plots inline.
    inline = {name: "data:image/png;base64," + base64.b64encode(image).decode() for name, image in plots.items()}
    create_markdown_artifact(
        key="run-report",
        markdown=markdown(store, config, splits, outputs, results, seconds, inline),
        description=f"finetune run {store.run_id}",
    )
    create_table_artifact(
        key="run-metrics",
        table=metric_rows(results),
        description=f"Final metrics of run {store.run_id}",
    )
    return store.report_md


@task
def publish_inference_report(model_ref: str, model_uri: str, parameters: dict, result: Labelled) -> None:
    """The batch_infer run's report: what labelled what, where the labels are, how fast."""
    named = f"`{model_ref}`, that is {link(model_uri)}" if model_ref != model_uri else link(model_uri)
    lines = [
        f"# batch_infer: {result.rows:,} rows labelled",
        "",
        f"Model: {named}",
        "",
        f"Labels: {link(result.output_uri)} (Parquet: id, text and the model's predictions; complete once "
        f"`{layout.MARKER}` is there)",
        "",
        f"{result.files} input file(s), {result.rows:,} rows in {result.seconds:.1f} s ({result.rows_per_s:,.0f} rows/s).",
        "",
        "## Parameters",
        "",
        "```json",
        json.dumps(parameters, indent=2, default=str),
        "```",
        "",
    ]
    create_markdown_artifact(
        key="batch-inference-report", markdown="\n".join(lines), description=f"{model_ref} -> {result.output_uri}"
    )
