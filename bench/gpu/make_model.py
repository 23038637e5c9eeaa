"""A BERT-sized sequence classifier, random init (seeded), with the uncased tokenizer in tok/ (MiniLM's).
python3 make_model.py OUT_DIR TOKENIZER_DIR [base|large|tiny]     (tiny: for a CPU check of the kit)"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

out, tok = Path(sys.argv[1]), Path(sys.argv[2])
size = sys.argv[3] if len(sys.argv) > 3 else "base"
torch.manual_seed(0)
dims = {
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}[size]
cfg = BertConfig(
    vocab_size=30522,
    num_labels=2,
    id2label={0: "negative", 1: "positive"},
    label2id={"negative": 0, "positive": 1},
    **dims,
)
m = BertForSequenceClassification(cfg)
m.save_pretrained(out)
for f in tok.iterdir():
    if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
        shutil.copy(f, out / f.name)
print("model", out, sum(p.numel() for p in m.parameters()) / 1e6, "M params")
