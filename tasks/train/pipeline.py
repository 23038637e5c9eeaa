"""A BERT-family sequence classifier as DeepSpeed pipeline stages: embeddings, each encoder layer,
then the head (pooler where the model has one, dropout, classifier), cut into stages of as many
encoder layers each. Runs in the training workers (tasks/train/worker.py); imports no Prefect.

Between stages travel the hidden states and the attention mask. DeepSpeed requires every floating
tensor sent between stages to get a gradient back, so the mask stays int64 and each layer builds
its additive mask from it, as the HF model does.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForSequenceClassification
from transformers.masking_utils import create_bidirectional_mask

from tasks.core.objective import mean_loss


class Embeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embeddings = model.base_model.embeddings

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask[, token type ids of a pair of texts]) -> (hidden states, mask)."""
        input_ids, mask, *types = inputs
        return self.embeddings(input_ids=input_ids, token_type_ids=types[0] if types else None), mask


class EncoderLayer(nn.Module):
    def __init__(self, model, index: int):
        super().__init__()
        self.layer, self.config = model.base_model.encoder.layer[index], model.config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = inputs
        additive = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)
        return self.layer(
            hidden, additive
        ), mask  # a first-token last layer (tasks/core/first_token.py) returns (batch, 1, hidden)


class Head(nn.Module):
    """What the HF classifier does after its encoder: BERT pools the first token and drops out;
    RoBERTa's and ELECTRA's classifiers take the first token themselves."""

    def __init__(self, model):
        super().__init__()
        self.pooler, self.dropout, self.classifier = (
            getattr(model.base_model, "pooler", None),
            getattr(model, "dropout", None),
            model.classifier,
        )
        self.logits: list[
            torch.Tensor
        ] = []  # of each micro-batch, for the metrics: the pipeline returns the loss alone

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = inputs
        pooled = self.pooler(hidden) if self.pooler is not None else hidden
        logits = self.classifier(self.dropout(pooled) if self.dropout is not None else pooled)
        self.logits.append(logits.detach())
        return logits


def pipe_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], config) -> torch.Tensor:
    """The last stage's loss: DeepSpeed hands a loss function the logits and the labels alone, so the
    labels travel with the positions of the rows that count (Replica.pipe_inputs)."""
    targets, real = labels
    return mean_loss(logits, targets, config, real)


def stages(model, count: int, activation_checkpointing: bool):
    """The PipelineModule of `model` in `count` stages, each with as many encoder layers (the
    embeddings go with the first, the head with the last), and the HF name of every tensor this
    rank's stage holds, by identity, for the export."""
    from deepspeed.pipe import PipelineModule

    names = {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}
    layers = [Embeddings(model), *(EncoderLayer(model, i) for i in range(model.config.num_hidden_layers)), Head(model)]
    module = PipelineModule(
        layers=layers,
        num_stages=count,
        loss_fn=partial(pipe_loss, config=model.config),
        partition_method="type:EncoderLayer",
        # each micro-batch is padded to its own longest row: without dynamic shapes the receiving
        # stage keeps the first one's buffer size, and gloo aborted on the first longer one
        dynamic_shape=True,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=["EncoderLayer"],
    )
    for parameter in module.parameters():
        # Under ZeRO-0, DeepSpeed's gradient clipping counts only the first stage's gradients in the
        # norm unless parameters say they are model-parallel (runtime/utils.py clip_grad_norm_):
        # without it, a 2-stage run drifted 7e-3 in loss from the same training in one process.
        parameter.model_parallel = True
    held = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
    return module, {key: name for key, name in names.items() if key in held}


def head(engine) -> Head | None:
    """The last stage's head (None on other stages)."""
    return next((layer for layer in engine.module.forward_funcs if isinstance(layer, Head)), None)


def consolidated(engine, names: dict[int, str], config) -> nn.Module | None:
    """On rank 0, the whole HF model rebuilt from every stage's tensors (of the first data-parallel
    replica); None elsewhere. Every rank must call it."""
    mine = (
        {names[id(tensor)]: tensor.detach().cpu() for tensor in engine.module.state_dict(keep_vars=True).values()}
        if engine.grid.data_parallel_id == 0
        else {}
    )
    parts: list[dict] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None
    model = AutoModelForSequenceClassification.from_config(config)
    model.load_state_dict({name: tensor for part in parts for name, tensor in part.items()})
    return model
