"""The run report's pictures, as PNG bytes (matplotlib's Agg figures, no display): training's curve,
the task's own (a confusion matrix, each label's scores, predicted against true numbers) and a sweep's
trials; PLOTS names their files beside the report."""

from __future__ import annotations

import io
from collections.abc import Callable

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from tasks.contracts.metrics import Metrics, MultiLabelMetrics, RegressionMetrics, TokenMetrics
from tasks.contracts.sweep import SweepResult
from tasks.contracts.training import Curve, Predictions
from tasks.core.data import Split
from tasks.core.sweep_config import Distribution
from tasks.core.tagging import OUTSIDE, scheme_of, type_of
from tasks.report.manifest import Results

PLOTS = {
    "training": "training.png",
    "confusion": "confusion-matrix.png",  # single_label
    "labels": "labels.png",  # multi_label
    "scatter": "predicted-vs-true.png",  # regression
    "entities": "entities.png",  # token_classification
    "sweep": "sweep.png",
    "sweep_curves": "sweep-curves.png",
}


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def training_plot(curve: Curve) -> bytes:
    """Loss, accuracy and entity F1 (where the task has them) against the optimizer step: training
    (averaged per logging interval) and validation (entity F1: validation only)."""
    points = curve.train + curve.validation
    measures = [m for m in ("loss", "accuracy", "entity_f1") if any(getattr(p, m) is not None for p in points)]
    figure = Figure(figsize=(5.5 * len(measures), 3.8))
    for axes, measure in zip(figure.subplots(1, len(measures), squeeze=False)[0], measures, strict=True):
        for series, name, style in ((curve.train, "training", "-"), (curve.validation, "validation", "o-")):
            shown = [p for p in series if getattr(p, measure) is not None]
            if shown:
                axes.plot([p.step for p in shown], [getattr(p, measure) for p in shown], style, label=name)
        axes.set(xlabel="optimizer step", ylabel=measure, title=measure)
        axes.grid(alpha=0.3)
        axes.legend()
    return png(figure)


def sweep_plot(sweep: SweepResult) -> bytes:
    return png(sweep_figure(sweep))


def sweep_figure(sweep: SweepResult) -> Figure:
    """Each trial's best validation metric against each searched field, stopped trials hollow (in the
    legend where there are some), the best trial marked: a choice field's values as categories, a
    log-uniform one's on a log axis."""
    figure = Figure(figsize=(5 * len(sweep.fields), 3.8))
    scored = [trial for trial in sweep.trials if trial.best is not None]
    for axes, name in zip(figure.subplots(1, len(sweep.fields), squeeze=False)[0], sweep.fields, strict=True):
        place = field_axis(axes, sweep.space.get(name))
        for status, style in (("finished", {}), ("stopped early", {"facecolors": "none"})):
            if not (shown := [trial for trial in scored if trial.status == status]):
                continue
            axes.scatter(
                [place(trial.config[name]) for trial in shown],
                [trial.best for trial in shown],
                edgecolors="C0",
                label=status,
                **style,
            )
        best = sweep.best()
        axes.scatter(
            [place(best.config[name])], [best.best], marker="*", s=220, color="C3", label=f"best: {best.trial_id}"
        )
        axes.set(xlabel=f"train.{name}", ylabel=f"best {sweep.metric}")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def sweep_curves_plot(sweep: SweepResult) -> bytes:
    return png(sweep_curves_figure(sweep))


def sweep_curves_figure(sweep: SweepResult) -> Figure:
    """Each trial's metric at each evaluation, what ASHA judged: the best trial's line bold, each stopped
    trial's last point crossed where the scheduler stopped it, its rungs faint verticals."""
    figure = Figure(figsize=(6.5, 4))
    axes = figure.subplots()
    for rung in sweep.rungs:
        axes.axvline(rung, color="grey", alpha=0.25, linewidth=1)
    for trial in sweep.trials:
        if not trial.curve:
            continue
        evaluations, values = zip(*trial.curve, strict=True)
        best = trial.trial_id == sweep.best_trial
        axes.plot(
            evaluations, values, "o-", linewidth=2.5 if best else 1, label=trial.trial_id + (" (best)" if best else "")
        )
        if trial.status == "stopped early":
            axes.plot(evaluations[-1], values[-1], "x", color="black", markersize=10)
    stopped = any(trial.status == "stopped early" for trial in sweep.trials)
    title = "each trial's evaluations" + (" (x: stopped by the scheduler)" if stopped else "")
    axes.set(xlabel="evaluation", ylabel=sweep.metric, title=title)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def field_axis(axes, space: Distribution | None) -> Callable[[object], object]:
    """Set a searched field's axis, and return where a value goes on it. A choice: one column per value,
    labelled as the trial table writes it. Log-uniform: a log axis, its labels at 1, 2 and 5 of each
    decade (matplotlib labels every minor tick of a short log range, and they ran together). Else linear.
    A range's axis spans it."""
    if space is None:
        return lambda value: value
    if space.choice is not None:
        axes.set_xticks(range(len(space.choice)), [space.shown(value) for value in space.choice])
        axes.set_xlim(-0.5, len(space.choice) - 0.5)
        return space.choice.index
    if space.loguniform is not None:
        axes.set_xscale("log")
        axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: space.shown(float(value))))
        axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlim(*(space.loguniform or space.uniform))  # the range searched, where the trials fell in it
    return lambda value: value


def confusion_plot(metrics: Metrics) -> bytes:
    names = metrics.label_names
    figure = Figure(figsize=(1.2 * len(names) + 2.5, 1.0 * len(names) + 2))
    confusion(figure.subplots(), names, metrics.confusion_matrix, f"test split, {metrics.rows} rows")
    return png(figure)


def confusion(axes, names: list[str], counts: list[list[int]], title: str) -> None:
    """A confusion matrix, true x predicted, each cell's count written in it."""
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
        title=title,
    )


def entity_counts(train: Split) -> dict[str, int]:
    """Entities per type in a split: its B- tags (plain tags: its words of each tag)."""
    names, counts = train.schema.label_names, {}
    plain = scheme_of(names) == "plain"
    for name, total in zip(names, train.tally.sums, strict=True):
        if name != OUTSIDE and (plain or name.startswith("B-")):
            counts[type_of(name)] = counts.get(type_of(name), 0) + int(total)
    return counts


def entity_plot(metrics: TokenMetrics, train: Split) -> bytes:
    """Each entity type's test F1 beside its entities in the training split (its B- tags; a plain tag's
    words), commonest first; and the words' confusion between entity types, O included."""
    counts = dict.fromkeys(metrics.type_names[1:], 0) | entity_counts(train)
    scored = {kind.name: kind.f1 for kind in metrics.types}
    kinds = sorted(counts, key=lambda kind: -counts[kind])
    figure = Figure(figsize=(2 * max(6, 0.5 * len(kinds) + 2) + 1, 4.8))
    bars, matrix = figure.subplots(1, 2)
    where = range(len(kinds))
    f1 = bars.bar(where, [scored.get(kind, 0.0) for kind in kinds], color="C0", label="test entity F1")
    bars.set_xticks(list(where), kinds, rotation=45, ha="right")
    bars.set(ylim=(0, 1), ylabel="test entity F1")
    bars.set_title(f"per type: entity F1 {metrics.entity_f1:.3f}", pad=22)
    bars.grid(alpha=0.3, axis="y")
    shares = bars.twinx()
    [entities] = shares.plot(where, [counts[kind] for kind in kinds], "o", color="C1", label="training entities")
    shares.set(ylabel="entities in the training split", ylim=(0, max(counts.values(), default=0) * 1.1 + 1))
    # above the bars, under the title: inside, it hid the dots of the commonest types
    bars.legend(
        handles=[f1, entities], loc="lower left", bbox_to_anchor=(0, 1), ncols=2, fontsize="small", frameon=False
    )
    confusion(matrix, metrics.type_names, metrics.confusion_matrix, "words by entity type (test)")
    matrix.tick_params(axis="x", rotation=45)
    figure.tight_layout()
    return png(figure)


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
    "token_classification": ("entities", "Per entity type (test)"),
}


def task_plot(results: Results, splits: dict[str, Split]) -> dict[str, bytes]:
    """The plot of the test split that fits the task: the confusion matrix, each label's F1 beside its
    frequency, or predicted against true."""
    metrics, (name, _) = results.test, TASK_SECTIONS[results.test.task]
    if isinstance(metrics, Metrics):
        return {name: confusion_plot(metrics)}
    if isinstance(metrics, MultiLabelMetrics):
        return {name: label_plot(metrics, splits["train"])}
    if isinstance(metrics, TokenMetrics):
        return {name: entity_plot(metrics, splits["train"])}
    return {name: scatter_plot(metrics, results.training.test)}
