"""`Predictor`: the one piece of code that turns texts into labels, used by the batch-inference
actors (tasks/infer/worker.py) and by the champion's re-scoring (tasks/promote/rescore.py) alike.

Kept apart from the Prefect tasks on purpose: every inference actor imports this module, and
leaving Prefect out of its imports starts each actor seconds sooner.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks.core.attention import without_cudnn_attention
from tasks.core.first_token import last_layer_at_first_token
from tasks.core.text import local_model, padded, truncating


class Predictor:
    """Texts -> (label, score). Each call encodes all its texts at once, orders them by token count
    and batches neighbours, so a batch pads to its own length rather than to the longest text of a
    random draw."""

    def __init__(self, model_uri: str, batch_size: int, threads: int | None = None, precision: str = "auto"):
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        without_cudnn_attention()
        dtype = (
            torch.bfloat16
            if precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
            else torch.float32
        )
        with local_model(model_uri) as folder:  # a folder: never the hub
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype, local_files_only=True)
            self.model = model.to(self.device).eval()
        last_layer_at_first_token(self.model)
        self.label_names = [self.model.config.id2label[i] for i in range(self.model.config.num_labels)]
        self.batch_size = batch_size
        max_length = min(tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", 512))
        self.encoder = truncating(tokenizer, max_length)
        self.pad_id = tokenizer.pad_token_id or 0  # any id does: the attention mask hides it

    @torch.inference_mode()
    def predict(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Label ids and their probabilities, in the order of `texts`."""
        encoded = [encoding.ids for encoding in self.encoder.encode_batch(texts)]
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        order = np.argsort(lengths, kind="stable")
        labels, scores = np.empty(len(texts), dtype=np.int64), np.empty(len(texts), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            chunk = order[start : start + self.batch_size]
            input_ids, attention_mask = self.padded([encoded[i] for i in chunk], lengths[chunk])
            probs = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float().softmax(-1)
            best = probs.max(-1)
            labels[chunk], scores[chunk] = best.indices.cpu().numpy(), best.values.cpu().numpy()
        return labels, scores

    def padded(self, rows: list[list[int]], lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = padded(rows, lengths, self.pad_id)
        return torch.from_numpy(input_ids).to(self.device), torch.from_numpy(attention_mask).to(self.device)
