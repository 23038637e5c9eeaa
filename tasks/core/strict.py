"""What every parameter model shares: unknown keys refused naming the closest known one, an error in
one line per problem, and the device choice."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

Device = Literal["auto", "cpu", "gpu"]
DEVICE = "auto: GPUs when the Ray cluster has some now; gpu: ask for them (an autoscaler adds GPU nodes); cpu: never."


class Strict(BaseModel):
    """A parameter model that refuses a key it does not know, naming the closest one it does: pydantic
    ignores unknown keys by default, so `{"train": {"epoch": 3}}` started a full default run. The
    check is a validator, so the same words reach a JSON or YAML file's reader, a deployment and the
    UI's form; extra="forbid" also tells the form's JSON schema (additionalProperties: false)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, given: Any) -> Any:
        for key in given if isinstance(given, dict) else ():
            if key not in cls.model_fields:
                close = difflib.get_close_matches(str(key), cls.model_fields, n=1)
                raise ValueError(
                    f"unknown parameter '{key}': "
                    + (f"did you mean '{close[0]}'?" if close else f"the known ones are {', '.join(cls.model_fields)}")
                )
        return given


def first_line(error: BaseException) -> str:
    """An error's message as one line, for a person: its first line, or its type where it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def one_line(error: ValidationError) -> str:
    """A parameter error as one line per problem, each naming where: `train: unknown parameter 'epoch':
    did you mean 'epochs'?` rather than pydantic's block with a documentation link."""
    return "; ".join(
        ": ".join(filter(None, [".".join(map(str, problem["loc"])), problem["msg"].removeprefix("Value error, ")]))
        for problem in error.errors()
    )
