"""GPU inference baseline: the plain loop a user writes (file order, batches of 256, bf16 autocast), on the
corpus ftflow infers, with torch's default attention kernel and without cuDNN's, as ftflow's Predictors run
(tasks/core/attention.py).    python3 infer_base.py MODEL CORPUS_DIR"""

import glob
import json
import sys
import time

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def label(model_dir: str, corpus: str, attention: str) -> None:
    torch.backends.cuda.enable_cudnn_sdp(attention == "torch")
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    texts = [json.loads(line)["text"] for f in sorted(glob.glob(corpus + "/*.jsonl")) for line in open(f)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForSequenceClassification.from_pretrained(model_dir).cuda().eval()
    preds = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(0, len(texts), 256):
            b = tok(texts[i : i + 256], truncation=True, max_length=128, padding=True, return_tensors="pt").to("cuda")
            preds.append(m(**b).logits.argmax(-1).cpu())
    n = sum(len(p) for p in preds)
    dt = time.perf_counter() - t0
    print(
        f"RESULT plain GPU bf16 inference loop, {attention} attention, batch 256: {n / dt:.0f} rows/s (model load "
        f"included), {n:,} rows, {dt:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
        flush=True,
    )


for attention in ("no-cudnn", "torch"):  # ftflow's kernel first: the one compared
    label(sys.argv[1], sys.argv[2], attention)
