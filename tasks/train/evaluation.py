"""A pass of the trained engine over an evaluation split (validation, test), on every worker: each
replica's rows predicted, gathered from all workers, and joined by row. A token classifier's long
texts come as several windows, each word predicted from the window where it sits farthest from an
edge (where it sees the most context). Worker side: imports no Prefect."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tasks.contracts.training import Predictions
from tasks.core.objective import mean_loss, outputs_of, real_rows
from tasks.core.tagging import OUTSIDE, Chosen, keep_farthest
from tasks.train.batches import evaluation_batches
from tasks.train.replica import Replica
from tasks.train.spec import WorkerSpec

# A window as evaluation gathers it: (row, the row's true tags, per token the word it starts (-1: none),
# its most probable tag, that tag's probability).
Window = tuple[int, list[int], list[int], list[int], list[float]]


@torch.no_grad()
def predicted(
    engine, replica: Replica, split: str, spec: WorkerSpec, pad_id: int, device: torch.device
) -> tuple[float, Predictions]:
    """Every row of a split as the engine predicts it, gathered from all workers (each replica's from
    the rank that holds its logits): the mean loss over its rows (windows), and the predictions by row.
    The padding rows are dropped by their row number (-1)."""
    engine.eval()
    task, local, loss_x_rows, rows = spec.targets.task, [], 0.0, 0
    tagged = task == "token_classification"
    for batch in evaluation_batches(
        spec.evaluation[split], spec.plan.micro_batch, spec.train, pad_id, pin=device.type == "cuda"
    ):
        batch = replica.join(batch, pad_id)
        logits = replica.logits(batch, device)
        if not replica.leads:
            continue
        logits, labels, real = logits.float().cpu(), batch["labels"], batch["row"] >= 0
        loss_x_rows += mean_loss(logits, labels, replica.config, real_rows(batch["row"])).item() * int(real.sum())
        rows += int(real.sum())
        local += window_words(logits, batch, real) if tagged else row_outputs(logits, batch, real, task)
    engine.train()  # training may go on mid-epoch
    gathered: list[tuple[float, int, list]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (loss_x_rows, rows, local))
    loss = sum(part[0] for part in gathered) / max(1, sum(part[1] for part in gathered))
    found = [item for part in gathered for item in part[2]]
    if tagged:
        return loss, joined_windows(found, spec.targets.names.index(OUTSIDE))
    found.sort()
    return loss, Predictions.of(task, [row[1] for row in found], [row[2] for row in found])


def row_outputs(logits: torch.Tensor, batch: dict, real: torch.Tensor, task: str) -> list[tuple]:
    """(row, outputs, target) of each real row of a micro-batch."""
    numbers, outputs = batch["row"][real].tolist(), outputs_of(logits, task)[real].tolist()
    return list(zip(numbers, outputs, batch["labels"][real].tolist(), strict=True))


def window_words(logits: torch.Tensor, batch: dict, real: torch.Tensor) -> list[Window]:
    """Each real window of a micro-batch, its padding cut off: its row, the row's true tags, and per token
    the word it starts, its most probable tag and that tag's probability."""
    scores, tags = logits.softmax(-1).max(-1)
    found, lengths = [], batch["attention_mask"].sum(1).tolist()
    for i in torch.nonzero(real).flatten().tolist():
        length = lengths[i]
        starts, window_tags, window_scores = (values[i][:length].tolist() for values in (batch["words"], tags, scores))
        found.append((int(batch["row"][i]), batch["tags"][i], starts, window_tags, window_scores))
    return found


def joined_windows(windows: list[Window], outside: int) -> Predictions:
    """Rows of windows as one prediction per word, in the order gathered (keep_farthest). A word no
    window holds a sub-token of (a character the tokenizer drops) is predicted O."""
    best: dict[int, Chosen] = {}
    gold: dict[int, list[int]] = {}
    for row, tags, starts, window_tags, window_scores in windows:
        gold[row] = tags
        keep_farthest(best.setdefault(row, {}), starts, window_tags, window_scores)
    rows = sorted(gold)
    tags = [[best[row].get(word, (0, outside, 0.0))[1] for word in range(len(gold[row]))] for row in rows]
    return Predictions(task="token_classification", tags=tags, gold=[gold[row] for row in rows])
