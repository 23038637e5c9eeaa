"""`Predictor`: the one piece of code that turns texts into labels, used by the batch-inference
actors and by evaluation alike.

Kept apart from the Prefect tasks on purpose: every inference actor imports this module, and
leaving Prefect out of its imports starts each actor seconds sooner.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks import storage


def local_model(model_uri: str) -> str:
    """A local folder holding the model: the path itself, or a download of a remote one."""
    if not storage.is_remote(model_uri):
        return model_uri
    return str(storage.download_dir(model_uri, tempfile.mkdtemp(prefix="ftflow-model-")))


class Predictor:
    """Texts -> (label, score). Each call sorts its texts by length and batches neighbours, so a
    batch pads to about its own length rather than to the longest text of a random draw."""

    def __init__(self, model_uri: str, batch_size: int = 64, threads: int | None = None, progress=None):
        folder = local_model(model_uri)
        self.progress = progress
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(self.device).eval()
        self.label_names = [self.model.config.id2label[i] for i in range(self.model.config.num_labels)]
        self.batch_size = batch_size

    @torch.inference_mode()
    def predict(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Label ids and their probabilities, in the order of `texts`."""
        order = np.argsort([len(t) for t in texts], kind="stable")
        ids, scores = np.empty(len(texts), dtype=np.int64), np.empty(len(texts), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            chunk = order[start : start + self.batch_size]
            encoded = self.tokenizer([texts[i] for i in chunk], padding=True, truncation=True, return_tensors="pt")
            probs = self.model(**encoded.to(self.device)).logits.float().softmax(-1)
            best = probs.max(-1)
            ids[chunk], scores[chunk] = best.indices.cpu().numpy(), best.values.cpu().numpy()
        return ids, scores

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        ids, scores = self.predict(batch["text"].tolist())
        if self.progress:
            self.progress.labelled.remote(len(batch))
        return batch.assign(label=np.asarray(self.label_names)[ids], score=scores)
