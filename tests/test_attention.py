"""The GPU processes' attention kernel: cuDNN's, which plans every new shape, is off."""

import torch

from tasks.core.predictor import Predictor


def test_a_predictor_turns_cudnn_attention_off(tiny_model):
    torch.backends.cuda.enable_cudnn_sdp(True)
    Predictor(str(tiny_model), batch_size=8)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
