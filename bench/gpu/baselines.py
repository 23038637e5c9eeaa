"""GPU baselines on ftflow's data and model: a plain bf16 PyTorch loop (rows in random order) and the HF
Trainer (bf16, group_by_length), one epoch each, in one process (imports and tokenization once).
    python3 baselines.py MODEL TRAIN.jsonl 32,256 [loop] [trainer]
Each with torch's default attention kernel and without cuDNN's, as ftflow's processes run
(tasks/core/attention.py); BASELINE_ATTENTION=torch or =no-cudnn runs one."""

import json
import os
import sys
import time

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

model_dir, data, batches = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
which = sys.argv[4:] or ["loop", "trainer"]
rows = [json.loads(line) for line in open(data)]
tok = AutoTokenizer.from_pretrained(model_dir)
enc = tok([r["text"] for r in rows], truncation=True, max_length=128)
labels = [r["label"] if isinstance(r["label"], int) else ["negative", "positive"].index(r["label"]) for r in rows]
n = len(rows)
real = sum(len(x) for x in enc["input_ids"])
print(f"rows {n}, mean tokens {real / n:.1f}")
dev = "cuda"


attention = "torch"  # the kernel choice of the baseline running: torch's default, or no-cudnn


def peak() -> str:
    return f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"


def loop(batch):
    torch.manual_seed(0)
    m = AutoModelForSequenceClassification.from_pretrained(model_dir).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-4, weight_decay=0.01, fused=True)
    steps = n // batch
    sch = get_linear_schedule_with_warmup(opt, int(0.1 * steps), steps)
    order = torch.randperm(n).tolist()
    t0 = None
    done = 0
    padded = 0
    start = time.perf_counter()
    for s in range(steps):
        idx = order[s * batch : (s + 1) * batch]
        b = tok.pad(
            {
                "input_ids": [enc["input_ids"][i] for i in idx],
                "attention_mask": [enc["attention_mask"][i] for i in idx],
            },
            return_tensors="pt",
        )
        b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
        y = torch.tensor([labels[i] for i in idx], device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(**b).logits.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sch.step()
        opt.zero_grad(set_to_none=True)
        if s == 4:  # steady state: after the first steps' kernel selection and allocations
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = 0
            padded = 0
        elif t0 is not None:
            done += len(idx)
            padded += b["input_ids"].numel()
    torch.cuda.synchronize()
    now = time.perf_counter()
    print(
        f"RESULT plain bf16 loop, {attention} attention, batch {batch}: {done / (now - t0):.1f} samples/s (steady), {peak()}, "
        f"{now - start:.1f} s for the epoch, {padded / (now - t0):.0f} padded tokens/s"
    )


def trainer(batch):
    torch.manual_seed(0)
    m = AutoModelForSequenceClassification.from_pretrained(model_dir)
    ds = [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": labels[i]}
        for i in range(n)
    ]
    kw = dict(
        output_dir="/tmp/hf_out",
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=2e-4,
        bf16=True,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        warmup_steps=int(0.1 * n / batch),
        dataloader_num_workers=0,
    )
    try:
        args = TrainingArguments(train_sampling_strategy="group_by_length", **kw)
    except TypeError:  # transformers before 5.x
        args = TrainingArguments(group_by_length=True, **kw)
    t = Trainer(model=m, args=args, train_dataset=ds, data_collator=DataCollatorWithPadding(tok))
    t0 = time.perf_counter()
    out = t.train()
    dt = time.perf_counter() - t0
    print(
        f"RESULT HF Trainer bf16 group_by_length, {attention} attention, batch {batch}: {n / dt:.1f} samples/s (whole train()), {peak()}, "
        f"{dt:.1f} s for the epoch, {out.metrics.get('train_samples_per_second')} samples/s as it reports"
    )


for attention in os.environ.get("BASELINE_ATTENTION", "torch,no-cudnn").split(","):
    torch.backends.cuda.enable_cudnn_sdp(attention == "torch")
    for w in which:
        for batch in batches:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            {"loop": loop, "trainer": trainer}[w](batch)
