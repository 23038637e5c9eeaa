"""The model copy a training worker holds a share of: plain data parallel, a tensor-parallel group or a
pipeline, trained and read through one interface, and the forward pass on the worker's device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist

from tasks.core.models import layers_of
from tasks.core.objective import mean_loss, real_rows
from tasks.core.text import model_inputs
from tasks.train import pipeline


def on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)  # from pinned memory: asynchronous, in order on the stream


def logits_of(engine, batch: dict, device: torch.device, inputs: tuple[str, ...]) -> torch.Tensor:
    return engine(**{name: on(device, batch[name]) for name in inputs if name in batch}).logits


def forward(engine, batch: dict, device: torch.device, config, inputs: tuple[str, ...]) -> tuple:
    """(mean loss over the batch's real rows, logits, labels); padding rows count for nothing."""
    labels, real = on(device, batch["labels"]), real_rows(batch["row"])
    logits = logits_of(engine, batch, device, inputs)
    return mean_loss(logits, labels, config, None if real is None else on(device, real)), logits, labels


class Replica:
    """The workers that hold one copy of the model between them, and how that copy trains and
    predicts. A tensor-parallel group splits every layer's matrices, so its ranks compute on the same
    rows; a pipeline's first stage needs the rows and its last the labels. Either way each rank still
    reads its own share of the data (Ray's split is unchanged) and the replica joins its ranks'
    micro-batches into one: the global batch stays micro-batch x accumulation x workers. The rank
    that holds the logits speaks for the replica in the metrics (the first of a tensor-parallel
    group, a pipeline's last stage)."""

    def __init__(self, engine, accumulation: int, config, names: dict[int, str] | None = None):
        from deepspeed.utils import groups

        self.engine, self.accumulation, self.names, self.config = engine, accumulation, names, config
        self.inputs = model_inputs(config)
        self.pending: list[dict] = []  # a pipeline's micro-batches of the step to come
        self.head = pipeline.head(engine) if names is not None else None  # a pipeline's last stage's head
        if names is not None:  # pipeline stages (tasks/train/pipeline.py)
            self.group, self.leads = engine.grid.get_pipe_parallel_group(), engine.is_last_stage()
        elif engine.autotp_size() > 1:
            self.group, self.leads = (
                groups.get_tensor_model_parallel_group(),
                groups.get_tensor_model_parallel_rank() == 0,
            )
        else:
            self.group, self.leads = None, True

    def join(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
        if self.group is None:
            return batch
        parts: list[dict] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, batch, group=self.group)
        width = max(part["input_ids"].shape[1] for part in parts)
        padding = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0}
        return {
            key: torch.cat(
                [
                    torch.nn.functional.pad(part[key], (0, width - part[key].shape[1]), value=padding[key])
                    if key in padding
                    else part[key]
                    for part in parts
                ]
            )
            for key in batch
        }

    def train(
        self, batch: dict, device: torch.device, offload: bool, alone
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        """Train on a micro-batch; yield (loss, logits or None on ranks without them, labels, row
        numbers on the host) of each micro-batch computed. A pipeline trains a whole step at once,
        once its micro-batches are in."""
        if self.names is None:
            # save_on_cpu keeps the tensors autograd saves for backward in host memory until needed.
            with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext(), alone():
                loss, logits, labels = forward(self.engine, batch, device, self.config, self.inputs)
                self.engine.backward(loss)
            self.engine.step()  # an optimizer step only at the end of an accumulation cycle
            yield loss, logits, labels, batch["row"]
            return
        self.pending.append(batch)
        if len(self.pending) < self.accumulation:
            return
        step, self.pending = self.pending, []
        loss = self.engine.train_batch(iter([self.pipe_inputs(part, device) for part in step]))
        logits = self.head.logits if self.head else [None] * len(step)
        for part, part_logits in zip(step, logits, strict=True):
            yield loss, part_logits, on(device, part["labels"]), part["row"]
        if self.head:
            self.head.logits.clear()

    def logits(self, batch: dict, device: torch.device) -> torch.Tensor | None:
        """Eval-mode logits of a micro-batch, on the ranks that hold them."""
        if self.names is None:
            return logits_of(self.engine, batch, device, self.inputs)
        _, logits = self.engine.eval_batch(
            iter([self.pipe_inputs(batch, device)]), return_logits=True, num_micro_batches=1
        )
        if self.head:
            self.head.logits.clear()
        return logits if self.leads else None

    @staticmethod
    def pipe_inputs(batch: dict, device: torch.device) -> tuple:
        """A micro-batch as a pipeline takes it: (inputs, labels), the labels with the positions of the
        real rows (every one, where all are), which the loss needs (pipeline.pipe_loss)."""
        real = real_rows(batch["row"])
        real = torch.arange(len(batch["row"])) if real is None else real
        names = ("input_ids", "attention_mask", "token_type_ids")
        inputs = tuple(on(device, batch[name]) for name in names if name in batch)
        return inputs, (on(device, batch["labels"]), on(device, real))

    def layers(self) -> list[torch.nn.Module]:
        """The encoder or decoder layers this worker holds (BERT-family and Llama-style models; none
        found for others)."""
        if self.names is not None:
            kinds = pipeline.EncoderLayer | pipeline.DecoderLayer
            return [layer.layer for layer in self.engine.module.forward_funcs if isinstance(layer, kinds)]
        return layers_of(self.engine.module)

    def exported(self) -> tuple[torch.nn.Module | None, dict | None]:
        """(model, state dict) for rank 0 to save, the whole model gathered from where it is split
        (ZeRO-3, tensor parallelism, pipeline stages): every rank must call it."""
        if self.names is not None:
            return pipeline.consolidated(self.engine, self.names, self.config), None
        split = self.group is not None or self.engine.zero_optimization_partition_weights()
        return self.engine.module, self.engine._consolidated_16bit_state_dict() if split else None
