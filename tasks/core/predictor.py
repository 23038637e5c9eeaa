"""`Predictor`: the one piece of code that turns texts into a model's predictions (classes, labels or
numbers: tasks/core/targets.py), used by the batch-inference actors (tasks/infer/worker.py) and by
the champion's re-scoring (tasks/promote/rescore.py) alike.

Kept apart from the Prefect tasks on purpose: every inference actor imports this module, and
leaving Prefect out of its imports starts each actor seconds sooner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

from tasks.core.attention import without_cudnn_attention
from tasks.core.config import InferenceEngine
from tasks.core.first_token import last_layer_at_first_token
from tasks.core.objective import outputs_of
from tasks.core.scoring import THRESHOLD
from tasks.core.tagging import OUTSIDE, Chosen, Tagged, keep_farthest, tagged_row, words_and_offsets
from tasks.core.targets import Targets, task_of
from tasks.core.text import (
    encoded,
    first_subtokens,
    local_model,
    model_inputs,
    padded,
    padding,
    truncating,
    windowing,
    windows,
)


class Predictor:
    """Texts -> predictions. Each call encodes all its texts at once, orders them by token count and
    batches neighbours, so a batch pads to its own length rather than to the longest text of a random
    draw. A multi-label model decides each label at the threshold it was saved with (THRESHOLD, 0.5,
    for a model saved without)."""

    def __init__(
        self,
        model_uri: str,
        batch_size: int,
        threads: int | None = None,
        precision: str = "auto",
        engine: InferenceEngine = "torch",
    ):
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
            tokenizer = padding(AutoTokenizer.from_pretrained(folder, local_files_only=True), model_uri)
            task = task_of(AutoConfig.from_pretrained(folder, local_files_only=True).to_dict())
            kind = (
                AutoModelForTokenClassification
                if task == "token_classification"
                else AutoModelForSequenceClassification
            )
            # a model exported elsewhere may say no pad token: the one ftflow pads with is its
            model = kind.from_pretrained(
                folder, dtype=dtype, local_files_only=True, pad_token_id=tokenizer.pad_token_id
            )
            self.model = model.to(self.device).eval()
        if engine != "deepspeed":  # DeepSpeed replaces the layers whole
            last_layer_at_first_token(self.model)
        self.forward = runner(self.model, engine, dtype)
        config = self.model.config
        self.targets = Targets(
            task=task,
            names=tuple(config.id2label[i] for i in range(config.num_labels)),
            pairs=getattr(config, "text_pair_truncation", None),
            stride=getattr(config, "window_stride", None),
        )
        self.thresholds = getattr(config, "label_thresholds", None) or [THRESHOLD] * self.targets.width
        self.batch_size = batch_size
        max_length = min(tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", 512))
        self.encoder = (
            windowing(tokenizer, max_length, self.targets.stride or 0)
            if task == "token_classification"
            else truncating(tokenizer, max_length, self.targets.pairs or "longest_first")
        )
        self.pad_id = tokenizer.pad_token_id
        self.types = "token_type_ids" in model_inputs(self.model.config)  # a pair's: BERT's, not a decoder's

    @property
    def label_names(self) -> list[str]:
        return list(self.targets.names)

    @torch.inference_mode()
    def outputs(self, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
        """Per text (or pair of texts, for a model trained on pairs), in order: its class
        probabilities, each label's probability, or its numbers."""
        if (pairs is None) != (self.targets.pairs is None):
            raise ValueError(f"the model reads {'pairs of texts' if self.targets.pairs else 'one text'} a row")
        ids, types = encoded(self.encoder, texts, pairs)
        lengths = np.array([len(row) for row in ids], dtype=np.int64)
        order = np.argsort(lengths, kind="stable")
        found = np.empty((len(texts), self.targets.width), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            chunk = order[start : start + self.batch_size]
            inputs = self.padded(
                [ids[i] for i in chunk], lengths[chunk], None if types is None else [types[i] for i in chunk]
            )
            found[chunk] = outputs_of(self.forward(**inputs).logits, self.targets.task).cpu().numpy()
        return found

    @torch.inference_mode()
    def tagged(self, rows: list) -> list[Tagged]:
        """Per row, a text (split into words here) or a list of words, in order: each word's tag and its
        probability, and its entities with their character offsets (tasks/core/tagging.py). A text
        longer than the model reads is read in windows, each word predicted from the window where it
        sits farthest from an edge."""
        words = [words_and_offsets(row) for row in rows]
        encodings = [
            (row, encoding)
            for row, found in enumerate(windows(self.encoder, [w[0] for w in words]))
            for encoding in found
        ]
        lengths = np.array([len(encoding.ids) for _, encoding in encodings], dtype=np.int64)
        order = np.argsort(lengths, kind="stable")
        best: list[Chosen] = [{} for _ in rows]
        for start in range(0, len(encodings), self.batch_size):
            chunk = order[start : start + self.batch_size]
            inputs = self.padded([encodings[i][1].ids for i in chunk], lengths[chunk], None)
            scores, tags = outputs_of(self.forward(**inputs).logits, self.targets.task).max(-1)  # on the device
            for i, window_tags, window_scores in zip(chunk, tags.tolist(), scores.tolist(), strict=True):
                row, encoding = encodings[i]
                keep_farthest(best[row], first_subtokens(encoding), window_tags, window_scores)
        outside = self.targets.names.index(OUTSIDE)
        return [tagged_row(*found, best[row], self.targets.names, outside) for row, found in enumerate(words)]

    def padded(self, rows: list[list[int]], lengths: np.ndarray, types: list | None) -> dict[str, torch.Tensor]:
        input_ids, attention_mask = padded(rows, lengths, self.pad_id)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if types is not None and self.types:
            inputs["token_type_ids"] = padded(types, lengths, 0)[0]
        return {name: torch.from_numpy(array).to(self.device) for name, array in inputs.items()}


def runner(model: torch.nn.Module, engine: InferenceEngine, dtype: torch.dtype) -> Callable[..., Any]:
    """What calls the model, by inference.engine (tasks/core/config.py)."""
    if engine == "compile":  # dynamic: each batch pads to its own longest row, a new length nearly every time
        return torch.compile(model, dynamic=True)
    if engine == "deepspeed":
        import deepspeed  # 9.4 s of import on the H200 machine: only where it runs

        return deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=True)
    return model
