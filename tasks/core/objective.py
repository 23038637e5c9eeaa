"""What a model optimizes and outputs for each task (tasks/core/targets.py), in torch on its device:
transformers' loss for the model's problem_type over the rows that count and which rows it got right
(training), its logits as the numbers a person reads (training and inference). Imports no Prefect.

A split is padded with a few copies of a real row, numbered -1, so that every worker gets as many
rows (tasks/train/ingest.py, batches.py): those count for no loss and no metric.
"""

from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForSequenceClassificationLoss, ForTokenClassification

from tasks.core.tagging import IGNORED


def real_rows(rows: torch.Tensor) -> torch.Tensor | None:
    """The positions of a micro-batch's real rows (row number >= 0), or None where every row is real;
    read from the host's row numbers, so no device sync."""
    real = rows >= 0
    return None if bool(real.all()) else torch.nonzero(real).flatten()


def mean_loss(logits: torch.Tensor, labels: torch.Tensor, config, real: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' loss for the model's problem_type (cross-entropy, binary cross-entropy per
    label, mean squared error), over the rows at `real` (all where None); a token classifier's
    (logits per token: rows x tokens x tags) cross-entropy over the tokens that carry a label. A
    micro-batch of padding rows alone, or of tokens that carry none, gives 0 with zero gradients, not
    NaN: every rank must still take its backward pass."""
    if real is not None:
        if not len(real):
            return logits.sum() * 0.0
        logits, labels = logits.index_select(0, real), labels.index_select(0, real)
    if logits.dim() == 3:  # the mean over labelled tokens, of none 0 (transformers' mean over none is NaN)
        labelled = (labels != IGNORED).sum().clamp(min=1)
        return ForTokenClassification(logits.float(), labels, config, num_items_in_batch=labelled)
    return ForSequenceClassificationLoss(labels, logits.float(), config)


def outputs_of(logits: torch.Tensor, task: str) -> torch.Tensor:
    """What the model says of each row: class probabilities, each label's probability, or the numbers;
    a token classifier, each token's tag probabilities."""
    logits = logits.float()
    if task in ("single_label", "token_classification"):
        return logits.softmax(-1)
    return logits.sigmoid() if task == "multi_label" else logits


def right(logits: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, task: str) -> torch.Tensor:
    """(what the model got right, of how many), over the real rows, as a tensor of two: rows with their
    class (single_label) or every label at the 0.5 threshold (multi_label: subset accuracy); tokens
    with their tag, of those that carry one (token_classification); regression has no right or wrong."""
    if task == "token_classification":
        counted = (labels != IGNORED) & real[:, None]
        return torch.stack([((logits.argmax(-1) == labels) & counted).sum(), counted.sum()])
    if task == "single_label":
        hits = logits.argmax(-1) == labels
    elif task == "multi_label":
        hits = ((logits > 0) == (labels > 0.5)).all(-1)
    else:
        hits = torch.zeros(len(labels), dtype=torch.bool, device=labels.device)
    return torch.stack([(hits & real).sum(), real.sum()])
