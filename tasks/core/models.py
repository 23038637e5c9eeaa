"""What names a model: a saved Hugging Face model's folder (local or remote) or a hub id, checked in
one line naming the field; from_pretrained's arguments that keep a folder off the hub; what the
driver reads of a model, from its files; and whether a tensor- or pipeline-parallel split fits it.

The driver reads a model's config.json and hashes its tokenizer's files without transformers: its
import took 10-11 s on an H200 machine (15 s with torch, bench/RESULTS.md) and 0.5-0.8 s on a 2-core
CPU, for a dict and a fingerprint. transformers loads a tokenizer only where one tokenizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import storage
from tasks.core.first_token import FIRST_TOKEN_CLASSIFIERS

if TYPE_CHECKING:
    from tasks.core.config import ModelConfig
    from tasks.core.train_config import Lora, TrainConfig

# The files transformers reads a tokenizer from, by its names for them (fixed order: the hash's).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)

# Llama-style decoders (token embeddings, decoder layers with rotary positions, a final norm, a score
# layer), which tasks/train/pipeline.py cuts into stages. GPT-2 is not one: DeepSpeed's AutoTP refuses
# it too (its kernel-injection policy claims it).
SPLITTABLE_DECODERS = {"llama", "mistral", "qwen2", "qwen3", "gemma"}
# The model types ftflow splits, by the field that splits them, each seen to train with the losses of
# data parallelism and to export (tests/test_train.py, tests/test_decoders.py). AutoTP splits the
# attention's query, key and value and the feed-forward's first matrices (gate and up) by columns, the
# attention output and the feed-forward's last by rows; embeddings, poolers and heads stay whole.
SPLITTABLE = {
    "tensor_parallel_size": FIRST_TOKEN_CLASSIFIERS | SPLITTABLE_DECODERS | {"deberta-v2"},
    "pipeline_parallel_size": FIRST_TOKEN_CLASSIFIERS | SPLITTABLE_DECODERS,
}


def hub_free(name_or_path: str) -> dict:
    """from_pretrained's arguments that keep it off the model hub for a folder or a path (the CLI and
    the deployments do not set HF_HUB_OFFLINE): where packets are dropped, a hub question waits ~10 s.
    transformers 5.23 asks nothing about an existing folder even without this (measured: no
    connection); it keeps that so across versions, and a path missing on a node fails at once."""
    path = Path(name_or_path).expanduser()
    return {"local_files_only": True} if "://" in name_or_path or path.is_absolute() or path.is_dir() else {}


# The weights transformers loads a PyTorch model from, whole or sharded (an index beside the shards).
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def saved_model(uri: str, field: str, weights: bool = True) -> str:
    """uri, a saved Hugging Face model's folder (local or remote), with its weights where `weights`
    asks (else its config is enough), as every node reads it: a local one made absolute (Ray's workers
    run in folders of their own). Else one line naming the field."""
    remote = storage.is_remote(uri)
    if not (storage.exists(uri) if remote else Path(uri).expanduser().is_dir()):
        raise ValueError(f"{field} {uri}: no such folder")
    if not storage.exists(storage.join(uri, "config.json")):
        raise ValueError(f"{field} {uri}: a folder without config.json, not a saved Hugging Face model")
    if weights and not any(storage.exists(storage.join(uri, name)) for name in WEIGHTS):
        # else refused in the training worker or the inference actor, once the cluster had started (45 s)
        raise ValueError(f"{field} {uri}: a folder without weights (none of {', '.join(WEIGHTS)})")
    return uri if remote else str(Path(uri).expanduser().resolve())


def names_folder(name_or_path: str) -> bool:
    """Whether model.name_or_path names a folder (a path), not a hub id ('org/name')."""
    path = Path(name_or_path).expanduser()
    return path.is_dir() or path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1


def training_model(model: ModelConfig) -> None:
    """model.name_or_path: a hub id (transformers resolves it when tokenizing: tasks/tokenize/), or a
    saved model's folder: with its weights, but for `init: random`, which reads its config alone."""
    if names_folder(model.name_or_path):
        saved_model(model.name_or_path, "model.name_or_path", weights=model.init == "pretrained")


def model_folder(name_or_path: str) -> str:
    """The folder that holds the model's config and tokenizer: the one named (checked for them), or the
    model hub's cached copy of a hub id, its config and tokenizer files fetched where missing (nothing is
    fetched under HF_HUB_OFFLINE). Else one line saying why."""
    if names_folder(name_or_path):
        saved_model(name_or_path, "model.name_or_path", weights=False)
    if hub_free(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download  # 0.2 s, and only for a hub id

    try:
        return snapshot_download(name_or_path, allow_patterns=["config.json", *TOKENIZER_FILES])
    except (OSError, ValueError) as error:  # not on the hub, not in its cache, or not a repo id
        offline = (
            " (HF_HUB_OFFLINE is set: nothing is downloaded)"
            if os.environ.get("HF_HUB_OFFLINE") in ("1", "true")
            else ""
        )
        raise ValueError(
            f"model.name_or_path {name_or_path}: not a folder here, and the Hugging Face hub does not resolve it"
            f"{offline}: {str(error).splitlines()[0]}"
        ) from None


def model_config(name_or_path: str) -> dict:
    """The model's config.json, as saved (transformers' AutoConfig adds its defaults and aliases)."""
    return storage.read_json(storage.join(model_folder(name_or_path), "config.json"))


def tokenizer_sha256(name_or_path: str) -> str:
    """A hash of the model's tokenizer files: what its token ids follow from."""
    folder = model_folder(name_or_path)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if storage.exists(uri := storage.join(folder, name)):
            digest.update(json.dumps([name, storage.sha256(uri)]).encode())
    return digest.hexdigest()


# Model types whose positions are a learned table (max_position_embeddings rows, RoBERTa's from 2 on):
# a longer text indexes past it, an error in the training worker. Rotary and relative positions read on.
LEARNED_POSITIONS = {"bert": 0, "electra": 0, "distilbert": 0, "albert": 0, "gpt2": 0, "roberta": 2, "xlm-roberta": 2}


def check_length(model: ModelConfig) -> None:
    """Refuse a model.max_length longer than the model's learned positions, from its config.json alone."""
    config = model_config(model.name_or_path)
    if (offset := LEARNED_POSITIONS.get(config.get("model_type"))) is None:
        return
    positions = (config.get("max_position_embeddings") or config.get("n_positions") or 0) - offset
    if positions and model.max_length > positions:
        raise ValueError(
            f"model.max_length {model.max_length}: {model.name_or_path} reads at most {positions} tokens "
            f"(its learned positions): set it to {positions} or less"
        )


def check_parallelism(cfg: TrainConfig, model: ModelConfig, task: str) -> None:
    """Refuse a split that the model cannot take, saying what to change, before any cluster work: the
    command's checks run it (tasks/validate/checks.py), from the model's config.json alone."""
    if cfg.model_parallel == 1:
        return
    name, size = cfg.split_field, cfg.model_parallel
    if cfg.lora:
        raise ValueError(
            f"train.{name}={size} with train.lora: ftflow trains adapters with data parallelism and ZeRO 0-3 "
            "(ZeRO-3 partitions a frozen base model as it does a whole one): set it to 1"
        )
    if task == "token_classification":
        raise ValueError(
            f"train.{name}={size}: ftflow splits sequence classifiers only; a token classifier trains with data "
            "parallelism and ZeRO 0-3 (offload fits a larger one): set it to 1"
        )
    config = model_config(model.name_or_path)
    if config.get("model_type") not in SPLITTABLE[name]:
        raise ValueError(
            f"train.{name}={size}: {model.name_or_path} is a '{config.get('model_type')}' model, and {name} "
            f"splits only {', '.join(sorted(SPLITTABLE[name]))}: set it to 1"
        )
    fields = (
        ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        if name == "tensor_parallel_size"
        else ("num_hidden_layers",)
    )
    for field in filter(config.__contains__, fields):  # an encoder has no key-value heads of its own
        if config[field] % size:
            raise ValueError(
                f"train.{name}={size} does not divide the model's {field}={config[field]}: "
                f"use a divisor of {config[field]}"
            )


def check_lora_targets(lora: Lora | None, name_or_path: str, task: str) -> None:
    """Refuse, in one line naming the modules the model has, a target module it does not have (peft says
    only that some were not found, once the cluster has loaded the model). The driver's check: the
    model built on the meta device from its config alone, in about a second."""
    if lora is None or lora.target_modules == "all-linear":
        return
    names = [name for name, *_ in linear_layers(meta_classifier(name_or_path, task))]
    for target in lora.target_modules:
        if not any(adapts(name, [target]) for name in names):
            short = sorted({name.rpartition(".")[2] for name in names})
            raise ValueError(
                f"train.lora.target_modules: {name_or_path} has no linear layer '{target}'; its linear layers "
                f"are {', '.join(short)} (or all-linear)"
            )


def adapts(name: str, targets: list[str] | str) -> bool:
    """Whether LoRA's target_modules take the layer of that dotted name: all-linear, or its name or its end."""
    return targets == "all-linear" or any(name == target or name.endswith(f".{target}") for target in targets)


def meta_classifier(name_or_path: str, task: str, labels: int = 2):
    """The model as ftflow trains it for `task` (a token or a sequence classifier of `labels` outputs),
    built on the meta device from its config alone: its structure, without weights or memory."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    folder = model_folder(name_or_path)
    head = AutoModelForTokenClassification if task == "token_classification" else AutoModelForSequenceClassification
    config = AutoConfig.from_pretrained(folder, num_labels=labels, **hub_free(folder))
    with torch.device("meta"):
        return head.from_config(config)


def linear_layers(model) -> list[tuple[str, int, int]]:
    """Every linear layer of `model` but its head (classifier, score), GPT-2's Conv1D too, as (dotted name,
    in features, out features): what LoRA's all-linear adapts."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return [
        (name, module.in_features, module.out_features)
        if isinstance(module, torch.nn.Linear)
        else (name, *module.weight.shape)  # Conv1D's weight is (in, out)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear | Conv1D) and name.split(".")[0] not in ("classifier", "score")
    ]


def layers_of(model) -> list:
    """A transformer's layers: a BERT-family encoder's (encoder.layer), a decoder's (layers); none for others."""
    base = model.base_model
    return list(getattr(getattr(base, "encoder", None), "layer", None) or getattr(base, "layers", None) or [])
