"""The last layer at the first token only: the same logits and gradients as the whole model."""

import pytest
import torch
from tiny_model import tiny_config
from transformers import AutoModelForSequenceClassification

from tasks.core.first_token import FIRST_TOKEN_CLASSIFIERS, last_layer_at_first_token


def tiny(model_type: str, dropout: float = 0.0) -> torch.nn.Module:
    config = tiny_config(model_type, num_labels=3, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def padded_batch() -> dict[str, torch.Tensor]:
    """Rows of 9, 5 and 2 tokens, padded to 9: the mask matters."""
    lengths = torch.tensor([9, 5, 2])
    mask = (torch.arange(9) < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(5, 100, (3, 9), generator=torch.Generator().manual_seed(1)) * mask,
        "attention_mask": mask,
    }


@pytest.mark.parametrize("model_type", sorted(FIRST_TOKEN_CLASSIFIERS))
def test_the_first_token_layer_gives_the_whole_models_logits_and_gradients(model_type):
    whole, pruned = tiny(model_type), tiny(model_type)
    keys = list(pruned.state_dict())
    assert last_layer_at_first_token(pruned)
    assert list(pruned.state_dict()) == keys  # what is saved is unchanged
    batch, labels = padded_batch(), torch.tensor([0, 2, 1])
    for model in (whole, pruned):
        model.train()  # dropout 0: train mode, so that gradients can be compared
        model(**batch, labels=labels).loss.backward()
    torch.testing.assert_close(pruned(**batch).logits, whole(**batch).logits)
    for (name, expected), (_, got) in zip(whole.named_parameters(), pruned.named_parameters(), strict=True):
        if expected.grad is None:
            assert got.grad is None, name
        else:
            torch.testing.assert_close(got.grad, expected.grad, msg=name)


def test_other_models_and_attention_are_left_whole():
    assert not last_layer_at_first_token(tiny("distilbert"))  # its layers are not BERT's
    eager = AutoModelForSequenceClassification.from_config(tiny("bert").config, attn_implementation="eager")
    assert not last_layer_at_first_token(eager)
