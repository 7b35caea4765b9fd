"""Load and validate posttrain manifests (YAML) with the same models the apiserver's
schemas are generated from, and turn pydantic errors into field-named messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.errors import UsageError

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
        got = f" (got {err['input']!r})" if err["type"] not in ("missing",) else ""
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {path or '<root>'}: {message}{got}")
    return "\n".join(lines)


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
