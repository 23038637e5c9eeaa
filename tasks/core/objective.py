"""What a model optimizes and outputs for each task (tasks/core/targets.py), in torch on its device:
transformers' loss for the model's problem_type over the rows that count and which rows it got right
(training), its logits as the numbers a person reads (training and inference). Imports no Prefect.

A split is padded with a few copies of a real row, numbered -1, so that every worker gets as many
rows (tasks/train/ingest.py, batches.py): those count for no loss and no metric.
"""

from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForSequenceClassificationLoss


def real_rows(rows: torch.Tensor) -> torch.Tensor | None:
    """The positions of a micro-batch's real rows (row number >= 0), or None where every row is real;
    read from the host's row numbers, so no device sync."""
    real = rows >= 0
    return None if bool(real.all()) else torch.nonzero(real).flatten()


def mean_loss(logits: torch.Tensor, labels: torch.Tensor, config, real: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' loss for the model's problem_type (cross-entropy, binary cross-entropy per
    label, mean squared error), over the rows at `real` (all where None). A micro-batch of padding
    rows alone gives 0 with zero gradients, not NaN: every rank must still take its backward pass."""
    if real is not None:
        if not len(real):
            return logits.sum() * 0.0
        logits, labels = logits.index_select(0, real), labels.index_select(0, real)
    return ForSequenceClassificationLoss(labels, logits.float(), config)


def outputs_of(logits: torch.Tensor, task: str) -> torch.Tensor:
    """What the model says of each row: class probabilities, each label's probability, or the numbers."""
    logits = logits.float()
    return logits.softmax(-1) if task == "single_label" else logits.sigmoid() if task == "multi_label" else logits


def right(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Per row, whether the model got it right: its class (single_label), or every label at the 0.5
    threshold (multi_label: subset accuracy); regression has no right or wrong (all False)."""
    if task == "single_label":
        return logits.argmax(-1) == labels
    if task == "multi_label":
        return ((logits > 0) == (labels > 0.5)).all(-1)
    return torch.zeros(len(labels), dtype=torch.bool, device=labels.device)
