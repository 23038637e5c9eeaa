"""The attention kernel every GPU process of ftflow runs (training workers, evaluation, inference)."""

from __future__ import annotations

import torch


def without_cudnn_attention() -> None:
    """Keep torch's SDPA off its cuDNN kernel, for this process.

    cuDNN's attention builds an execution plan for every new input shape. ftflow's batches are
    grouped by length and each pads to its own longest row, so nearly every batch of a first epoch
    (and of every validation and inference pass) has a shape not seen before. On an H100 (torch
    2.11, BERT-base, batch 256, bf16) a training step at a new length took 495 ms with torch's
    default choice (cuDNN) and 51 ms with the memory-efficient kernel, the same 47-49 ms at lengths
    seen before; ftflow's ZeRO-2 epoch at batch 256 went from 501 to 2,349 samples/s, 1.2x a plain
    bf16 loop's 1,958 (bench/RESULTS.md, "GPU"). Without cuDNN, SDPA picks the memory-efficient
    kernel, which takes any shape and any mask without a plan. Nothing changes on a CPU.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)
