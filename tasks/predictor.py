"""`Predictor`: the one piece of code that turns texts into labels, used by the batch-inference
actors and by evaluation alike.

Kept apart from the Prefect tasks on purpose: every inference actor imports this module, and
leaving Prefect out of its imports starts each actor seconds sooner.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from tasks import storage
from tasks.data import Split, labelled_frames
from tasks.first_token import last_layer_at_first_token


def local_model(model_uri: str) -> str:
    """A local folder holding the model: the path itself, or a download of a remote one."""
    if not storage.is_remote(model_uri):
        return model_uri
    return str(storage.download_dir(model_uri, tempfile.mkdtemp(prefix="ftflow-model-")))


def truncating(tokenizer: PreTrainedTokenizerBase, max_length: int) -> Tokenizer:
    """The fast tokenizer's Rust core, set to encode as `tokenizer(texts, truncation=True,
    max_length=max_length)` does, without padding. Called on a whole list at once it skips the
    Python work transformers does per call (a third of a small model's inference time), and it
    unpickles in Ray workers without importing transformers."""
    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    core.enable_truncation(max_length, direction=tokenizer.truncation_side)
    core.no_padding()
    return core


def padded(rows: list, lengths: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, attention mask) of a batch of token id rows, padded to its longest row: the one
    padding of ftflow, for training batches and inference alike. Written out rather than the
    tokenizer's `pad`: 21 vs 328 µs for a batch of 16 reviews here."""
    input_ids = np.full((len(rows), lengths.max()), pad_id, dtype=np.int64)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = ids
    return input_ids, (np.arange(input_ids.shape[1]) < lengths[:, None]).astype(np.int64)


class Predictor:
    """Texts -> (label, score). Each call encodes all its texts at once, orders them by token count
    and batches neighbours, so a batch pads to its own length rather than to the longest text of a
    random draw."""

    def __init__(self, model_uri: str, batch_size: int, threads: int | None = None, precision: str = "auto"):
        folder = local_model(model_uri)
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = (
            torch.bfloat16
            if precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
            else torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)  # a folder: never the hub
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype, local_files_only=True)
            .to(self.device)
            .eval()
        )
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


def confusion(model_uri: str, split: Split, batch_size: int, threads: int) -> tuple[np.ndarray, list[str]]:
    """The confusion matrix (true x predicted) of a model on a labelled split, streamed a chunk at a
    time, and the model's label names: run as a Ray task, so no model is loaded by the driver."""
    predictor = Predictor(model_uri, batch_size, threads)
    ids = list(range(len(predictor.label_names)))
    counts = np.zeros((len(ids), len(ids)), dtype=np.int64)
    for uri in split.uris:
        for frame in labelled_frames(uri, split.schema):  # a chunk at a time, never the whole split
            predicted, _ = predictor.predict(frame["text"].tolist())
            np.add.at(counts, (frame["label"].to_numpy(), predicted), 1)
    return counts, predictor.label_names
