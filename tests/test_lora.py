"""LoRA through peft: adapters train and the base model stays frozen, the head in full; the export is one
folder with the adapters merged, and the adapter alone beside it, which peft loads to the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fault_injected
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_file
from test_train import (  # noqa: F401 (tokenized: the tokenized reviews, a fixture)
    assert_model_is_the_trained_engine,
    fit,
    logits_of,
    model_logits,
    tokenized,
    validation_rows,
)
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks.core.sweep_config import SweepParams, with_drawn
from tasks.core.train_config import Lora, TrainConfig
from tasks.train.strategy import ModelSize

# ZeRO-0 in bf16 with accumulation (1 worker x micro-batch 4 x 4: 2 workers, 4 s more, proved nothing
# more; ZeRO-3's adapters train on 2), and ZeRO-3 partitioning the frozen model on 2 workers, killed at
# step 3 and resumed from step 2's checkpoint.
STRATEGIES = {
    "zero0-bf16-accumulation": {"zero_stage": 0, "precision": "bf16", "num_workers": 1, "micro_batch_size": 4},
    "zero3-resumed": {"zero_stage": 3, "num_workers": 2, "checkpoint_every_steps": 2},
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_trains_adapters_and_exports_them_merged_and_alone(strategy, tokenized, tiny_model):  # noqa: F811
    root, uris = tokenized
    lora = Lora(r=4, alpha=8)
    cfg = TrainConfig(max_steps=4, batch_size=16, eval_every_steps=0, lora=lora, **STRATEGIES[strategy])
    with fault_injected(step=3) if strategy == "zero3-resumed" else torch.no_grad():
        result = fit(uris, tiny_model, cfg, Path(root) / "runs" / strategy)
    run = Path(root) / "runs" / strategy
    assert result.history[-1].step == 4
    if strategy == "zero3-resumed":
        assert result.history[-1].resumed_from_step == 2
        # resumed from a checkpoint of the trained parameters alone: the frozen ones loaded again
        checkpoints = [folder for folder in (run / "train" / "ray").glob("checkpoint_*") if folder.is_dir()]
        model_bytes = (run / "model" / "model.safetensors").stat().st_size
        assert len(checkpoints) == 2 and all(folder_bytes(folder) < model_bytes / 2 for folder in checkpoints)
    # what peft counts as trainable in the same adapters on the base model: the run trained that many
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules="all-linear")
    trainable, every = get_peft_model(base, config).get_nb_trainable_parameters()
    assert (result.trained_parameters, result.parameters) == (trainable, every) and trainable < every / 5
    assert ModelSize.of(str(tiny_model), 2).lora_params(lora) == trainable, "strategy=auto's count"
    assert_model_is_the_trained_engine(run / "model", uris, result.history[-1].val_accuracy)
    exported, before = load_file(run / "model" / "model.safetensors"), load_file(tiny_model / "model.safetensors")
    embeddings = "bert.embeddings.word_embeddings.weight"
    assert torch.equal(exported[embeddings], before[embeddings]), "the base model is frozen"
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(exported[query], before[query]), "the adapters are merged into the weights they adapt"
    # the adapter alone, on the base model, is the merged model
    adapter = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(tiny_model), run / "adapter")
    rows, pad = validation_rows(uris.validation)[:32], AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    assert torch.allclose(model_logits(adapter, pad, rows), logits_of(run / "model", rows), atol=1e-4)


def test_a_sweep_searches_the_lora_rank(tiny_model, small_data, tmp_path):
    """train.lora.r in a space: every trial trains LoRA at its drawn rank, the run's other fields kept."""
    params = SweepParams.model_validate(
        {
            "data": {"train_uri": str(small_data["train"]), "validation_uri": str(small_data["validation"])},
            "model": {"name_or_path": str(tiny_model)},
            "storage_root": str(tmp_path),
            "train": {"learning_rate": 1e-3},
            "sweep": {"space": {"train.lora.r": {"choice": [4, 16]}}},
        }
    )
    assert params.sweep.fields()["lora.r"].choice == [4, 16] and params.train.lora == Lora()
    trial = TrainConfig.model_validate(with_drawn(params.train.model_dump(), {"lora.r": 16}))
    assert trial.lora == Lora(r=16) and trial.learning_rate == 1e-3
    with pytest.raises(ValueError, match=r"sweep.space.train.lora.r: 0: .*greater than or equal to 1"):
        SweepParams.model_validate(params.model_dump() | {"sweep": {"space": {"train.lora.r": {"choice": [0]}}}})


def folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())
