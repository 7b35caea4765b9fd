"""Layer contracts, checked on every import statement (including those inside functions).

The architecture in README.md is types -> components -> CLI. These tests keep it true:

- ``api/`` (the pydantic models, CRD generator, label keys) imports nothing of ours except the
  leaf ``posttrain.errors``, so every component can depend on it and it on none of them;
- the operator and the trainer never import each other: they meet through ``api/`` and the
  cluster, so the operator image needs no torch and the trainer no kopf;
- ``posttrain.devenv`` (the development control plane and node agent) is a developer aid: only
  the CLI, tests and benchmarks import it, never a component that runs in a cluster.

import-linter cannot express these here: ``operator/`` is deliberately a PEP 420 portion
without ``__init__.py`` (so it never shadows the stdlib ``operator``), which grimp does not
walk. The check below is the same idea over the ast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("api", "operator", "trainer", "rollout", "sandboxes", "storage", "envs")
LEAVES_ANYONE_MAY_IMPORT = ("posttrain.errors",)


def _module_name(path: Path) -> str:
    """``trainer/loop.py`` -> ``posttrain.trainer.loop``; ``posttrain/ctl.py`` -> ``posttrain.ctl``."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[0] != "posttrain":
        parts.insert(0, "posttrain")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, package: str | None = None) -> Iterator[str]:
    """Every module a file imports, relative imports resolved, at any nesting level.

    ``package`` is the file's package (derived from its place in the repository if omitted).
    """
    if package is None:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            # ``from posttrain import devenv`` imports a module by its attribute name.
            yield from (f"{target}.{alias.name}" for alias in node.names)


def _files(component: str) -> list[Path]:
    return sorted((REPO_ROOT / component).rglob("*.py"))


def _violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for component in sources:
        for path in _files(component):
            for module in imported_modules(path):
                if any(module == f or module.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(REPO_ROOT)} imports {module}")
    return sorted(set(found))


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    # The contracts below are only as good as this walk: it must not miss a deferred import.
    sample = tmp_path / "probe.py"
    sample.write_text(
        "def f():\n    from posttrain.operator import builders\n    from . import loop\n"
    )
    found = set(imported_modules(sample, package="posttrain.trainer"))
    assert {"posttrain.operator.builders", "posttrain.trainer.loop"} <= found


def test_api_imports_nothing_of_ours() -> None:
    components = tuple(f"posttrain.{c}" for c in COMPONENTS if c != "api")
    cli_and_tools = (
        "posttrain.devenv",
        "posttrain.cli",
        "posttrain.ctl",
        "posttrain.telemetry",
        "posttrain.processes",
    )
    ours = (*components, *cli_and_tools)
    assert _violations(("api",), ours) == []


@pytest.mark.parametrize(("source", "target"), [("operator", "trainer"), ("trainer", "operator")])
def test_operator_and_trainer_never_import_each_other(source: str, target: str) -> None:
    assert _violations((source,), (f"posttrain.{target}",)) == []


def test_only_the_cli_tests_and_benchmarks_import_the_dev_environment() -> None:
    assert _violations(COMPONENTS, ("posttrain.devenv",)) == []


def test_nothing_imports_a_component_by_its_bare_folder_name() -> None:
    # ``import storage.metrics`` beside ``posttrain.storage.metrics`` would load the module twice
    # (two Prometheus registrations); everything goes through ``posttrain.<component>``.
    bare = tuple(c for c in COMPONENTS if c != "operator")
    for folder in (*COMPONENTS, "posttrain", "tests", "bench"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for module in imported_modules(path):
                assert module.split(".")[0] not in bare, f"{path} imports {module}"
