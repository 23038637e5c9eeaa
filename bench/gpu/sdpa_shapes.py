"""What a new sequence length costs each SDPA backend: BERT-base training steps (bf16 autocast, batch 256,
padded rows) over 20 lengths never seen before, then over the same lengths again. Length-grouped
batches (ftflow, the HF Trainer's group_by_length) meet a new length at almost every step of the first
epoch; a backend that builds a plan per shape pays for it there.
    python3 bench/gpu/sdpa_shapes.py MODEL [BATCH]"""

import sys
import time
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForSequenceClassification

model_dir, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256
model = AutoModelForSequenceClassification.from_pretrained(model_dir).cuda()
backends = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
    "efficient+math": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def step(length: int) -> None:
    ids = torch.randint(1000, 20000, (batch, length), device="cuda")
    mask = torch.ones_like(ids)
    mask[batch // 2 :, length // 2 :] = 0  # half the rows padded, as a length group's shortest are
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def timed(lengths: list[int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for length in lengths:
        step(length)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(lengths) * 1000


step(8)  # CUDA context, cuBLAS handles
for offset, (name, chosen) in enumerate(backends.items()):
    lengths = list(range(20 + offset, 120, len(backends)))  # each backend's own, never seen before
    try:
        with sdpa_kernel(chosen) if chosen else nullcontext():
            new, seen = timed(lengths), timed(lengths)
        print(
            f"RESULT sdpa {name}, batch {batch}: {new:.1f} ms/step at {len(lengths)} new lengths, {seen:.1f} ms/step at the same again"
        )
    except RuntimeError as error:
        print(f"RESULT sdpa {name}: fails: {str(error).splitlines()[0][:160]}")
