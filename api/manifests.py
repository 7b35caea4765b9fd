"""Load and validate posttrain manifests (YAML) with the same models the apiserver's
schemas are generated from, and turn pydantic errors into field-named messages."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.errors import UsageError

from .base import ApiModel
from .rolloutpool import RolloutPool
from .sandboxtask import SandboxTask
from .sandboxwarmpool import SandboxWarmPool
from .trainingrun import TrainingRun

Resource = TrainingRun | RolloutPool | SandboxTask | SandboxWarmPool
KINDS: dict[str, type[BaseModel]] = {
    "TrainingRun": TrainingRun,
    "RolloutPool": RolloutPool,
    "SandboxTask": SandboxTask,
    "SandboxWarmPool": SandboxWarmPool,
}


def models_by_name() -> dict[str, type[BaseModel]]:
    """Every API model by class name: a ValidationError's title names the root of its paths."""
    found: dict[str, type[BaseModel]] = {}
    pending: list[type[BaseModel]] = [ApiModel]
    while pending:
        model = pending.pop()
        found[model.__name__] = model
        pending += model.__subclasses__()
    return found


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem, each naming the camelCase field path.

    >>> from posttrain.api.sandboxtask import SandboxTaskSpec
    >>> try:
    ...     SandboxTaskSpec.model_validate({"command": ["x"], "timeoutSeconds": 0})
    ... except ValidationError as e:
    ...     print(format_validation_error(e, "task.yaml"))
    task.yaml: invalid manifest:
      timeoutSeconds: Input should be greater than or equal to 1 (got 0)
    """
    lines = [f"{source}: invalid manifest:"]
    for err in exc.errors():
        path = ""
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        got = f" (got {shown_value(err['input'])})" if err["type"] not in ("missing",) else ""
        message = err["msg"].removeprefix("Value error, ")
        hint = ""
        root = models_by_name().get(exc.title)
        if err["type"] == "extra_forbidden" and root is not None:
            hint = did_you_mean(root, err["loc"])
        lines.append(f"  {path or '<root>'}: {message}{got}{hint}")
    return "\n".join(lines)


SHOWN_VALUE_CHARS = 120  # an error echoes the offending value, never a whole 1000-domain list


def shown_value(value: Any, limit: int = SHOWN_VALUE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters so an error stays one readable line.

    >>> shown_value({"kind": "numeric"})
    "{'kind': 'numeric'}"
    >>> shown_value(list(range(1000)), limit=20)
    '[0, 1, 2, 3, 4, 5, 6… (4890 chars)'
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


def field_names(model: type[BaseModel]) -> list[str]:
    """The names a manifest may use for ``model``'s fields (their camelCase aliases)."""
    return [info.alias or name for name, info in model.model_fields.items()]


def model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model that validates the object at ``loc`` inside ``model`` (None if not a model).

    >>> from posttrain.api.trainingrun import TrainingRun
    >>> model_at(TrainingRun, ("spec", "domains", 0)).__name__
    'DomainSpec'
    """
    current: Any = model
    for part in loc:
        current = _model_type(current)
        if current is None:
            return None
        if isinstance(part, int):
            current = _element_type(current)
            continue
        fields = {info.alias or name: info for name, info in current.model_fields.items()}
        info = fields.get(part) or current.model_fields.get(part)
        if info is None:
            return None
        current = info.annotation
    found = _model_type(current)
    return found if isinstance(found, type) and issubclass(found, BaseModel) else None


def _model_type(annotation: Any) -> Any:
    """Unwrap ``X | None`` (and keep lists as they are); a model class or the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _model_type(members[0])
        return None
    if origin is typing.Annotated:
        return _model_type(typing.get_args(annotation)[0])
    return annotation if origin in (list, tuple, dict) else None


def _element_type(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    return args[-1] if args else None


def did_you_mean(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """``; did you mean 'verifier'?`` for a misspelt field, else an empty string.

    >>> from posttrain.api.trainingrun import TrainingRun
    >>> did_you_mean(TrainingRun, ("spec", "domains", 0, "verfier"))
    "; did you mean 'verifier'?"
    """
    parent = model_at(model, tuple(loc[:-1]))
    if parent is None or not isinstance(loc[-1], str):
        return ""
    names = field_names(parent)
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; allowed here: {', '.join(sorted(names))}" if len(names) <= 12 else ""


def parse_resource(obj: dict[str, Any], source: str = "<manifest>") -> Resource:
    """Validate one decoded manifest by its ``kind``."""
    if not isinstance(obj, dict):
        raise UsageError(
            f"{source}: expected a mapping with apiVersion/kind, got {type(obj).__name__}"
        )
    kind = obj.get("kind")
    model = KINDS.get(str(kind))
    if model is None:
        raise UsageError(f"{source}: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    try:
        return model.model_validate(obj)  # type: ignore[return-value]
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc, source)) from None


def load_manifests(path: str | Path) -> list[Resource]:
    """Every posttrain resource in a (multi-document) YAML file."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {exc}") from None
    if not docs:
        raise UsageError(f"{path}: contains no manifest")
    return [parse_resource(doc, f"{path} (document {i + 1})") for i, doc in enumerate(docs)]


def load_manifest(path: str | Path, kind: type[BaseModel] | None = None) -> Any:
    """The single resource in ``path`` (of type ``kind`` when given)."""
    resources = load_manifests(path)
    if kind is not None:
        resources = [r for r in resources if isinstance(r, kind)]
        if not resources:
            raise UsageError(f"{path}: contains no {kind.__name__}")
    if len(resources) != 1:
        raise UsageError(f"{path}: expected one resource, found {len(resources)}")
    return resources[0]
