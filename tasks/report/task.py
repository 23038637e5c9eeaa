"""The run report: what a person reads after a finetune run, as Prefect artifacts (a markdown report
with its plots inline, a metrics table) and as files beside the run (<run>/report/report.md with
the same plots as PNG), so that it outlives the Prefect database and can be linked to."""

from __future__ import annotations

import base64
import io
import itertools
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
from matplotlib.figure import Figure
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.contracts.labels import Labelled
from tasks.contracts.metrics import AnyMetrics, Metrics, MultiLabelMetrics, RegressionMetrics, details_markdown
from tasks.contracts.promotion import Decision
from tasks.contracts.sweep import SweepResult, shown
from tasks.contracts.training import Curve, Marks, Predictions, Result
from tasks.core import layout, storage
from tasks.core.data import Split
from tasks.core.layout import RunStore
from tasks.core.progress import STAGE
from tasks.prefect_side.retries import RETRY_TRANSIENT
from tasks.report.manifest import Outputs, Results, versions

PLOTS = {
    "training": "training.png",
    "confusion": "confusion-matrix.png",  # single_label
    "labels": "labels.png",  # multi_label
    "scatter": "predicted-vs-true.png",  # regression
    "sweep": "sweep.png",
}


class Stopwatch:
    """Wall seconds per stage of a flow, and its fixed costs around training, phase by phase. Prefect
    records task-run times too, but its API holds them only once its event pipeline has caught up, so a
    report reading them at the end would race it. Each stage's start and end are logged, marked for the
    console."""

    process_started: float | None = psutil.Process().create_time()  # for the first flow a process runs only

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.logger, self.started, self.points, self.seconds = logger, time.time(), {}, {}
        # A command's or a deployment run's process starts for its flow; a notebook's or a server's
        # runs others before, and its start says nothing of this one.
        self.process_started, Stopwatch.process_started = Stopwatch.process_started, None

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.logger.info("%s", stage, extra={STAGE: ("start", stage)})
        self.points[f"{stage} began"] = started = time.time()
        yield
        self.points[f"{stage} ended"] = time.time()
        self.seconds[stage] = round(self.points[f"{stage} ended"] - started, 2)
        self.logger.info("%s: %.1f s", stage, self.seconds[stage], extra={STAGE: ("end", stage)})

    def mark(self, point: str) -> None:
        self.points[point] = time.time()

    def fixed_costs(self, training: Marks | None) -> None:
        """From the flow's start to training's first step and from training's end to now (the report),
        and "phases": every second of the process, from its start to now, as the gaps between the points
        the flow and training's rank 0 reached (the workers' clock: NTP keeps nodes within milliseconds)."""
        marks = training or Marks(started=self.points["train began"])
        now = time.time()
        if marks.first_step:  # a re-run of a finished run takes no step
            self.seconds["start to first training step"] = round(marks.first_step - self.started, 2)
        self.seconds["training's end to the report"] = round(now - self.points["train ended"], 2)
        points = [
            ("imports and Prefect's start", self.process_started),
            ("checks and Ray's start", self.started),
            ("tokenize", self.points["cluster ready"]),
            ("Ray Train's worker processes", self.points["train began"]),
            ("process group, model and engine", marks.started),
            ("first batch from the data pipeline", marks.engine_built),
            ("first micro-batch", marks.first_batch),
            ("training steps", marks.first_step),
            ("last validation, checkpoint, test labels", marks.last_step),
            ("export and Ray Train's end", marks.test_labelled),
            ("evaluate, promote, batch inference, report", self.points["train ended"]),
            ("end", now),
        ]
        reached = [(phase, at) for phase, at in points if at]
        self.seconds["phases"] = {
            phase: round(end - start, 2) for (phase, start), (_, end) in itertools.pairwise(reached)
        }


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def training_plot(curve: Curve) -> bytes:
    """Loss and accuracy (where the task has one) against the optimizer step: training (averaged per
    logging interval) and validation."""
    measures = ("loss", "accuracy") if curve.train and curve.train[0].accuracy is not None else ("loss",)
    figure = Figure(figsize=(5.5 * len(measures), 3.8))
    for axes, measure in zip(figure.subplots(1, len(measures), squeeze=False)[0], measures, strict=True):
        for points, name, style in ((curve.train, "training", "-"), (curve.validation, "validation", "o-")):
            axes.plot([p.step for p in points], [getattr(p, measure) for p in points], style, label=name)
        axes.set(xlabel="optimizer step", ylabel=measure, title=measure)
        axes.grid(alpha=0.3)
        axes.legend()
    return png(figure)


def sweep_plot(sweep: SweepResult) -> bytes:
    """Each trial's best validation metric against each searched field (log scale for a positive
    range spanning a decade or more), stopped trials hollow, the best trial marked."""
    figure = Figure(figsize=(5 * len(sweep.fields), 3.8))
    scored = [trial for trial in sweep.trials if trial.best is not None]
    for axes, name in zip(figure.subplots(1, len(sweep.fields), squeeze=False)[0], sweep.fields, strict=True):
        for status, style in (("finished", {}), ("stopped early", {"facecolors": "none"})):
            shown = [trial for trial in scored if trial.status == status]
            axes.scatter(
                [trial.config[name] for trial in shown],
                [trial.best for trial in shown],
                edgecolors="C0",
                label=status,
                **style,
            )
        best = sweep.best()
        axes.scatter([best.config[name]], [best.best], marker="*", s=220, color="C3", label=f"best: {best.trial_id}")
        values = [trial.config[name] for trial in scored if isinstance(trial.config[name], int | float)]
        if values and min(values) > 0 and max(values) / min(values) >= 10:
            axes.set_xscale("log")
        axes.set(xlabel=f"train.{name}", ylabel=f"best {sweep.metric}")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    return png(figure)


def trial_rows(sweep: SweepResult) -> list[dict]:
    return [
        {
            "trial": f"**{trial.trial_id}**" if trial.trial_id == sweep.best_trial else trial.trial_id,
            **{f"train.{name}": shown(trial.config[name]) for name in sweep.fields},
            "status": trial.status,
            f"last {sweep.metric}": None if trial.last is None else round(trial.last, 4),
            f"best {sweep.metric}": None if trial.best is None else round(trial.best, 4),
            "steps": trial.step,
            "seconds": None if trial.seconds is None else round(trial.seconds, 1),
            "how it ended": trial.how,
        }
        for trial in sweep.trials
    ]


def sweep_lines(sweep: SweepResult, image: str, stored: str) -> list[str]:
    best = sweep.best()
    return [
        "## Sweep",
        "",
        f"{len(sweep.trials)} trials; the best by {sweep.metric} ({sweep.direction}imized), trial **{best.trial_id}**, "
        "is the model evaluated, gated and used for inference below.",
        "",
        f"![best {sweep.metric} against the searched fields]({image})",
        "",
        stored,
        "",
        *table(trial_rows(sweep)),
        "",
    ]


def confusion_plot(metrics: Metrics) -> bytes:
    names, counts = metrics.label_names, metrics.confusion_matrix
    figure = Figure(figsize=(1.2 * len(names) + 2.5, 1.0 * len(names) + 2))
    axes = figure.subplots()
    axes.imshow(counts, cmap="Blues")
    peak = max(map(max, counts))
    for row, values in enumerate(counts):
        for column, count in enumerate(values):
            axes.text(column, row, str(count), ha="center", va="center", color="white" if count > peak / 2 else "black")
    axes.set(
        xticks=range(len(names)),
        yticks=range(len(names)),
        xticklabels=names,
        yticklabels=names,
        xlabel="predicted",
        ylabel="true",
        title=f"test split, {metrics.rows} rows",
    )
    return png(figure)


def link(uri: str, under: str = "") -> str:
    """A link to a stored file, named by its path below `under` when it is there (shorter tables)."""
    name = uri.removeprefix(f"{under}/") if under else uri
    return f"[`{name}`]({uri if storage.is_remote(uri) else 'file://' + uri})"


def label_plot(metrics: MultiLabelMetrics, train: Split) -> bytes:
    """Each label's test F1 beside its share of the training rows, rarest last."""
    shares = dict(zip(train.schema.targets.names, train.tally.means, strict=True))
    labels = sorted(metrics.labels, key=lambda label: -shares[label.name])
    figure = Figure(figsize=(max(6, 0.35 * len(labels) + 2), 4.2))
    axes = figure.subplots()
    where = range(len(labels))
    axes.bar([x - 0.2 for x in where], [label.f1 for label in labels], 0.4, label="test F1")
    axes.bar([x + 0.2 for x in where], [shares[label.name] for label in labels], 0.4, label="share of training rows")
    axes.set_xticks(list(where), [label.name for label in labels], rotation=60, ha="right")
    axes.set(title=f"per label, at its threshold: micro F1 {metrics.micro_f1:.3f}, macro F1 {metrics.macro_f1:.3f}")
    axes.grid(alpha=0.3, axis="y")
    axes.legend()
    return png(figure)


def scatter_plot(metrics: RegressionMetrics, test: Predictions) -> bytes:
    """Predicted against true, per output, with the identity line and Pearson's r."""
    figure = Figure(figsize=(4.5 * len(metrics.outputs), 4.2))
    for column, (axes, output) in enumerate(
        zip(figure.subplots(1, len(metrics.outputs), squeeze=False)[0], metrics.outputs, strict=True)
    ):
        truth, predicted = [row[column] for row in test.targets], [row[column] for row in test.outputs]
        axes.scatter(truth, predicted, s=6, alpha=0.4)
        low, high = min(truth + predicted), max(truth + predicted)
        axes.plot([low, high], [low, high], color="C3", linewidth=1)
        axes.set(xlabel=f"true {output.name}", ylabel="predicted", title=f"{output.name}: r = {output.pearson:.3f}")
        axes.grid(alpha=0.3)
    return png(figure)


# Each task's section on the test split: its plot's name (PLOTS) and title.
TASK_SECTIONS = {
    "single_label": ("confusion", "Confusion matrix (test)"),
    "multi_label": ("labels", "Per label (test)"),
    "regression": ("scatter", "Predicted against true (test)"),
}


def task_plot(results: Results, splits: dict[str, Split]) -> dict[str, bytes]:
    """The plot of the test split that fits the task: the confusion matrix, each label's F1 beside its
    frequency, or predicted against true."""
    metrics, (name, _) = results.test, TASK_SECTIONS[results.test.task]
    if isinstance(metrics, Metrics):
        return {name: confusion_plot(metrics)}
    if isinstance(metrics, MultiLabelMetrics):
        return {name: label_plot(metrics, splits["train"])}
    return {name: scatter_plot(metrics, results.training.test)}


def task_lines(metrics: AnyMetrics, images: dict[str, str], plot_link) -> list[str]:
    name, title = TASK_SECTIONS[metrics.task]
    return [f"## {title}", "", f"![{title}]({images[name]})", "", plot_link(name), "", details_markdown(metrics), ""]


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
    kept = results.training.kept
    if kept and kept.step != last.step:  # keep_best exported an earlier step than the last
        monitor = "accuracy" if kept.validation.accuracy is not None else "loss"
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
            "train loss": round(e.train_loss, 4),
            "val loss": round(e.val_loss, 4),
            **({"val accuracy": round(e.val_accuracy, 4)} if e.val_accuracy is not None else {}),
            "samples/s": round(e.samples_per_s, 1),
            "peak MiB per worker": round(e.peak_memory_mb),
        }
        for e in training.history
    ]


def data_rows(splits: dict[str, Split], tokenized: dict[str, str], root: str) -> list[dict]:
    return [
        {
            "split": name,
            "rows": split.total_rows,
            "MiB": round(sum(p.size for p in split.pieces) / 2**20, 2),
            "files": len(split.uris),
            "sha256": f"`{split.sha256[:12]}`",
            "tokenized": link(tokenized[name], root),
        }
        for name, split in splits.items()
    ]


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
    stored = {
        "model": outputs.model,
        "metrics": outputs.metrics,
        "predictions": outputs.predictions.output_uri,
        "training checkpoints": outputs.checkpoints,
        "report and plots": outputs.report,
        "manifest (config, versions, data hashes)": outputs.manifest,
        "champion pointer": results.promotion.pointer,
    }

    def plot_link(name: str) -> str:
        return f"Stored as {link(storage.join(store.report, PLOTS[name]), root)}"

    lines = [
        f"# {'sweep' if results.sweep else 'finetune run'} `{store.run_id}`",
        "",
        f"Run folder: {link(store.base)}",
        "",
        *summary(results.test, results.promotion),
        *(sweep_lines(results.sweep, images["sweep"], plot_link("sweep")) if results.sweep else []),
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
        *task_lines(results.test, images, plot_link),
        "## Data",
        "",
        *table(data_rows(splits, outputs.tokenized, root)),
        "",
        f"Predictions: {outputs.predictions.rows} rows from {outputs.predictions.files} file(s).",
        "",
        "## Timings",
        "",
        *table([{"stage": stage, "seconds": s} for stage, s in seconds.items() if stage != "phases"]),
        "",
        *phase_lines(seconds.get("phases", {})),
        "## Stored artifacts",
        "",
        *table([{"what": what, "where": link(uri, root)} for what, uri in stored.items()]),
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
