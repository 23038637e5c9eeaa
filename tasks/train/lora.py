"""LoRA through peft: adapters on a model's linear layers, the new head trained in full, and the
export: one Hugging Face folder with the adapters merged (what `ftflow infer` and transformers load
as they are), and the adapter alone beside it (peft's own folder, the head in it). The command's check
of the target modules is tasks/core/models.py `check_lora_targets`.

peft's merge is not ZeRO-aware (a ZeRO-3 worker holds a shard of each weight), so rank 0 merges the
trained adapters and head from the consolidated weights: into the engine's own frozen weights, or into
the checkpoint loaded afresh on its CPU where the engine holds them rounded to 16 bits.
Worker side: imports no Prefect.
"""

from __future__ import annotations

import tempfile

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model

from tasks.core import storage
from tasks.core.train_config import Lora


def peft_config(lora: Lora, task: str, new_modules: list[str]) -> LoraConfig:
    """peft's config for `lora`: `new_modules`, those the checkpoint did not have (the head, DeBERTa's
    pooler), train in full beside peft's own classifier names (classifier, score)."""
    return LoraConfig(
        task_type=TaskType.TOKEN_CLS if task == "token_classification" else TaskType.SEQ_CLS,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=new_modules or None,
    )


def new_modules(missing_keys: list[str]) -> list[str]:
    """The modules whose weights from_pretrained did not find in the checkpoint: initialised at random,
    they must train in full (an adapter on a random matrix learns little)."""
    return sorted({key.rpartition(".")[0] for key in missing_keys if "." in key})


def adapted(model: torch.nn.Module, lora: Lora, task: str, missing_keys: list[str]) -> PeftModel:
    """`model` with adapters, everything else frozen. Under ZeRO-3 the base model is already partitioned:
    the adapters are plain parameters, which DeepSpeed partitions at initialize, and peft gathers a
    partitioned head to copy it (its ModulesToSaveWrapper). The adapters keep the model's dtype
    (autocast_adapter_dtype=False): the engine sets the training precision of every parameter."""
    return get_peft_model(model, peft_config(lora, task, new_modules(missing_keys)), autocast_adapter_dtype=False)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trained) parameters of the whole model, a ZeRO-3 partition counted at its full size."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(size for size, _ in sizes), sum(size for size, trained in sizes if trained)


def merged(
    model: PeftModel, weights: dict[str, torch.Tensor], adapter_uri: str, checkpoint: torch.nn.Module | None
) -> tuple[torch.nn.Module, dict]:
    """Rank 0: the model with the trained adapters and head of `model`'s consolidated `weights` merged
    in, and its state dict; the adapter alone (adapter_config.json, adapter_model.safetensors) is written
    to `adapter_uri`. The frozen weights are `checkpoint`'s (loaded whole on the CPU) where one is given:
    a bf16 engine holds them rounded, with no fp32 copy (its optimizer has none). Else they are the
    engine's own, in `weights`, taken as they are: no second copy of the model (a 1B-parameter model
    in fp32 is 4 GiB more on rank 0)."""
    config = model.peft_config[model.active_adapter]
    if checkpoint is None:  # a skeleton, its tensors the engine's
        with torch.device("meta"):
            base = model.get_base_model()
            fresh = get_peft_model(type(base)(base.config), config, autocast_adapter_dtype=False)
        fresh.load_state_dict(weights, assign=True)
    else:
        fresh = get_peft_model(checkpoint, config, autocast_adapter_dtype=False)
        trained = [name for name, parameter in fresh.named_parameters() if parameter.requires_grad]
        fresh.load_state_dict({name: weights[name] for name in trained}, strict=False)
    with tempfile.TemporaryDirectory() as folder:
        fresh.save_pretrained(folder)
        storage.move_dir(folder, adapter_uri)
    whole = fresh.merge_and_unload()
    return whole, whole.state_dict()
