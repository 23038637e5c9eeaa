"""A sequence classifier as DeepSpeed pipeline stages, cut into stages of as many layers each:
a BERT-family encoder's embeddings, encoder layers, then its head (pooler where the model has one,
dropout, classifier); a Llama-style decoder's token embeddings, decoder layers, then its final norm
and score layer at each row's last real token. Runs in the training workers (tasks/train/worker.py);
imports no Prefect.

Between stages travel the hidden states and the attention mask. DeepSpeed requires every floating
tensor sent between stages to get a gradient back, so the mask stays int64 and each layer builds
its own mask from it (bidirectional, causal or sliding-window), as the HF model does.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForSequenceClassification
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
)

from tasks.core.models import SPLITTABLE_DECODERS
from tasks.core.objective import mean_loss


class Embeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embeddings = model.base_model.embeddings
        # ELECTRA's embeddings are narrower than its layers (128 and 256 in electra-small): a projection between
        self.project = getattr(model.base_model, "embeddings_project", None)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask[, token type ids of a pair of texts]) -> (hidden states, mask)."""
        input_ids, mask, *types = inputs
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=types[0] if types else None)
        return (self.project(hidden) if self.project is not None else hidden), mask


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


class DecoderEmbeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embed_tokens = model.base_model.embed_tokens  # Gemma's scales by sqrt(hidden) itself

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask) -> (hidden states, mask): a decoder takes no token type ids."""
        input_ids, mask, *_ = inputs
        return self.embed_tokens(input_ids), mask


class DecoderLayer(nn.Module):
    """One decoder layer with what the HF model computes once for all of them: the positions, their
    rotary embeddings (each stage holds the rotary module: it has no parameters) and the layer's mask."""

    def __init__(self, model, index: int):
        super().__init__()
        base = model.base_model
        self.layer, self.rotary, self.config = base.layers[index], base.rotary_emb, model.config
        sliding = getattr(self.layer, "attention_type", None) == "sliding_attention" or (
            not hasattr(self.layer, "attention_type") and getattr(model.config, "sliding_window", None)
        )  # Qwen's layers say which they are; Mistral's all slide when its config has a window
        self.masked = create_sliding_window_causal_mask if sliding else create_causal_mask

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        causal = self.masked(
            config=self.config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None, position_ids=positions
        )
        embedded = self.rotary(hidden, position_ids=positions)
        return self.layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=embedded), mask


class DecoderHead(nn.Module):
    """The final norm and the score layer at each row's last real token (rows are padded on the right):
    the token the HF classifier pools, normed and scored alone (the norm is per token)."""

    def __init__(self, model):
        super().__init__()
        self.norm, self.score = model.base_model.norm, model.score
        self.logits: list[torch.Tensor] = []

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, mask = inputs
        last = hidden[torch.arange(len(hidden), device=hidden.device), mask.sum(-1) - 1]
        logits = self.score(self.norm(last))
        self.logits.append(logits.detach())
        return logits


def pipe_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], config) -> torch.Tensor:
    """The last stage's loss: DeepSpeed hands a loss function the logits and the labels alone, so the
    labels travel with the positions of the rows that count (Replica.pipe_inputs)."""
    targets, real = labels
    return mean_loss(logits, targets, config, real)


def pipe_layers(model) -> list[nn.Module]:
    """The model as a sequence of pipeline layers: an encoder's or a Llama-style decoder's."""
    count = model.config.num_hidden_layers
    if model.config.model_type in SPLITTABLE_DECODERS:
        return [DecoderEmbeddings(model), *(DecoderLayer(model, i) for i in range(count)), DecoderHead(model)]
    return [Embeddings(model), *(EncoderLayer(model, i) for i in range(count)), Head(model)]


def stages(model, count: int, activation_checkpointing: bool):
    """The PipelineModule of `model` in `count` stages, each with as many encoder or decoder layers
    (the embeddings go with the first, the head with the last), and the HF name of every tensor this
    rank's stage holds, by identity, for the export."""
    from deepspeed.pipe import PipelineModule

    names = {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}
    module = PipelineModule(
        layers=pipe_layers(model),
        num_stages=count,
        loss_fn=partial(pipe_loss, config=model.config),
        partition_method="type:(Encoder|Decoder)Layer$",
        # each micro-batch is padded to its own longest row: without dynamic shapes the receiving
        # stage keeps the first one's buffer size, and gloo aborted on the first longer one
        dynamic_shape=True,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=["EncoderLayer", "DecoderLayer"],
    )
    for parameter in module.parameters():
        # Under ZeRO-0, DeepSpeed's gradient clipping counts only the first stage's gradients in the
        # norm unless parameters say they are model-parallel (runtime/utils.py clip_grad_norm_):
        # without it, a 2-stage run drifted 7e-3 in loss from the same training in one process.
        parameter.model_parallel = True
    held = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
    return module, {key: name for key, name in names.items() if key in held}


def head(engine) -> Head | DecoderHead | None:
    """The last stage's head (None on other stages)."""
    return next((layer for layer in engine.module.forward_funcs if isinstance(layer, Head | DecoderHead)), None)


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
