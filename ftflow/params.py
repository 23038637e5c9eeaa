"""The command's parameters: a --params file (YAML or JSON) and --set assignments into FinetuneParams,
the fields' help, and the defaults as a commented YAML file; every problem a BadInput line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from tasks.core.config import FinetuneParams
from tasks.core.strict import one_line

Params = TypeVar("Params", bound=FinetuneParams)


class BadInput(Exception):
    """A parameter the command refuses: one line, exit code 2."""


def fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted name, default, description) of every leaf field of a parameter model, in order."""
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from fields(kind, f"{prefix}{name}.")
        else:
            default = to_jsonable_python(
                field.get_default(call_default_factory=True), exclude_none=True
            )  # a sweep's space
            yield f"{prefix}{name}", default, field.description or ""


def fields_help(model: type[BaseModel]) -> str:
    """--help's list of every field, its default and description (rich markup, a paragraph each)."""
    return "\n\n".join(
        f"[bold]{name}[/] = {json.dumps(default)}" + (f"  {escape(about)}" if about else "")
        for name, default, about in fields(model)
    )


def escape(text: str) -> str:
    return text.replace("[", r"\[")


def as_yaml(model: type[BaseModel]) -> str:
    """The defaults as a YAML file for --params, each field under its description as a comment."""
    lines = ["# ftflow run --params <this file>: FinetuneParams; leave out what keeps its default."]
    section = None
    for name, default, about in fields(model):
        *parents, leaf = name.split(".")
        if parents and parents[0] != section:
            section = parents[0]
            lines.append(f"{section}:")
        indent = "  " if parents else ""
        if about:
            lines.append(f"{indent}# {about}")
        lines.append(f"{indent}{leaf}: {json.dumps(default)}")  # JSON is YAML: quoted paths, lists, null
    return "\n".join(lines) + "\n"


def value(text: str) -> Any:
    """A --set or option value as YAML reads it: 3 -> int, 1e-4 -> float, [a, b] -> list, null -> None;
    the text as typed where YAML reads nothing from it but its own syntax (read_nothing): `|` alone
    is an empty block to YAML, and `--set data.label_separator=|` was refused as an empty separator."""
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if parsed is None:
        return None if text.strip() in ("null", "~", "None") else text
    return text if read_nothing(text, parsed) else parsed


def read_nothing(text: str, parsed: Any) -> bool:
    """YAML made an empty string, or a list or mapping of nulls alone, of a text not quoted or
    bracketed: a block's `|` or `>`, a tag's `!!str`, a list's `-`, a key's `?`."""
    if text.strip()[:1] in ("'", '"', "[", "{"):
        return False  # '' and [null] say what they mean
    if isinstance(parsed, dict):
        parsed = [*parsed, *parsed.values()]
    if isinstance(parsed, list):
        return all(item is None for item in parsed)
    return parsed == ""


def assigned(params: dict, assignment: str) -> dict:
    """params with one `a.b=v` of --set applied (a copy)."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise BadInput(f"--set {assignment}: expected FIELD=VALUE, e.g. train.epochs=3")
    *parents, leaf = path.strip().split(".")
    result = json.loads(json.dumps(params))
    where = result
    for parent in parents:
        where = where.setdefault(parent, {})
        if not isinstance(where, dict):
            raise BadInput(f"--set {assignment}: {parent} is not a group of fields")
    where[leaf] = value(text)
    return result


def read_params(path: Path) -> dict:
    try:
        text = path.read_text()
        given = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as error:
        raise BadInput(f"{path}: {error.strerror}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise BadInput(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {' '.join(str(error).split())}"
        ) from None
    if not isinstance(given or {}, dict):
        raise BadInput(f"{path}: expected a mapping of parameters, got {type(given).__name__}")
    return given or {}


def parameters(model: type[Params], params_file: Path | None, assignments: list[str]) -> Params:
    """The command's parameters (FinetuneParams, or a sweep's): the file, then each --set over it."""
    given = read_params(params_file) if params_file else {}
    for assignment in assignments:
        given = assigned(given, assignment)
    try:
        return model.model_validate(given)
    except ValidationError as error:
        where = f"{params_file}: " if params_file else ""
        raise BadInput(where + one_line(error)) from None
