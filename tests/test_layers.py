"""Layer contracts, checked on every import statement (including those inside functions).

The architecture in README.md is types -> components -> CLI. These tests keep it true:

- ``api/`` (the pydantic models, CRD generator, label keys) imports nothing of ours except the
  leaf ``posttrain.errors``, so every component can depend on it and it on none of them;
- the operator and the trainer never import each other: they meet through ``api/`` and the
  cluster, so the operator image needs no torch;
- ``posttrain.devenv`` (the development control plane and node agent) is a developer aid: only
  the CLI, tests and benchmarks import it, never a component that runs in a cluster;
- no import cycle, between modules or between packages (``posttrain.<component>``).

import-linter cannot express these here: ``operator/`` is deliberately a PEP 420 portion
without ``__init__.py`` (so it never shadows the stdlib ``operator``), which grimp does not
walk. The check below is the same idea over the ast.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("api", "operator", "trainer", "rollout", "sandboxes", "storage", "envs")
LEAVES_ANYONE_MAY_IMPORT = ("posttrain.errors",)


def _module_name(path: Path) -> str:
    """``trainer/run/loop.py`` -> ``posttrain.trainer.run.loop``;
    ``posttrain/cli.py`` -> ``posttrain.cli``."""
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


# The trainer's packages by role, lowest first: a module may import its own package and those
# listed before it, never one after (torchtitan's components sit under its trainer the same way).
TRAINER_LAYERS = (
    "data",  # task records, their sources, curriculum, SFT/DPO data, the rollout producer
    "rewards",  # verifiers where spec.sandbox says, model-based scorers, the answer's score
    "algorithms",  # advantages, the policy-gradient loss, SFT, DPO, the log-prob forward
    "model",  # the training engine, the policy, LoRA, sharded loading, export, weight sync
    "checkpointing",  # exact-resume checkpoints and per-rank shard reads
    "evaluation",  # held-out evaluation and the off-path checkpoint evaluator
    "observe",  # step metrics, status, audits, the end-of-run report
    "run",  # the loop, its stages, the launcher and the CLI entry points
)


def trainer_layer(module: str) -> str | None:
    """The role package of a trainer module (``posttrain.trainer.run.loop`` -> ``run``).

    >>> trainer_layer("posttrain.trainer.model.policy"), trainer_layer("posttrain.rollout.client")
    ('model', None)
    """
    parts = module.split(".")
    return parts[2] if parts[:2] == ["posttrain", "trainer"] and len(parts) > 2 else None


def test_every_trainer_module_lives_in_a_role_package() -> None:
    flat = sorted(
        str(p.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / "trainer").glob("*.py")
        if p.name != "__init__.py"
    )
    assert flat == [], "put it in one of " + ", ".join(TRAINER_LAYERS)
    packages = sorted(p.parent.name for p in (REPO_ROOT / "trainer").glob("*/__init__.py"))
    assert packages == sorted(TRAINER_LAYERS)


def test_trainer_packages_import_only_those_below_them() -> None:
    # A package that imported one above it would make the two one unit (a cycle between
    # packages even where the modules are acyclic): what both need belongs in the lower one.
    found = []
    for path in _files("trainer"):
        source = trainer_layer(_module_name(path))
        if source is None:
            continue
        for module in imported_modules(path):
            target = trainer_layer(module)
            if target is not None and TRAINER_LAYERS.index(target) > TRAINER_LAYERS.index(source):
                found.append(
                    f"{path.relative_to(REPO_ROOT)} ({source}) imports {module} ({target})"
                )
    assert sorted(set(found)) == []


def test_no_trainer_module_shares_its_name_with_another_module() -> None:
    # "report" or "engine" should name one room: a reader (or a traceback) that says
    # progress.py must not leave open which of three it means.
    others: dict[str, list[str]] = {}
    for folder in (*COMPONENTS, "posttrain", "bench"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py" and folder != "trainer":
                others.setdefault(path.stem, []).append(str(path.relative_to(REPO_ROOT)))
    names: dict[str, list[str]] = {}
    for path in sorted((REPO_ROOT / "trainer").rglob("*")):
        if path.name == "__init__.py" or path.name.startswith("__pycache__"):
            continue
        if path.suffix == ".py" or (path / "__init__.py").exists():
            names.setdefault(path.stem, []).append(str(path.relative_to(REPO_ROOT)))
    clashes = {
        name: where + others.get(name, [])
        for name, where in names.items()
        if len(where) > 1 or name in others
    }
    assert clashes == {}


# ------------------------------------------------------------------ cycles and private names

SOURCE_FOLDERS = (*COMPONENTS, "posttrain")

# Debt, listed so that no new one can appear unnoticed: each entry must still exist (the test
# below fails once it is gone, so the list only shrinks). Issue #21 tracks them.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE_IMPORTS: set[str] = set()


def _our_modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for folder in SOURCE_FOLDERS
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
    }


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``target`` names (``a.b.func`` -> ``a.b``), if any."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (at any nesting level, relative resolved)."""
    modules = _our_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imported_modules(path):
            found = _resolve(target, modules)
            if found is not None and found != name:
                graph[name].add(found)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative).

    >>> sorted(sorted(c) for c in import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}))
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert import_cycles(graph) == {frozenset({"a", "b", "c"})}
    assert import_cycles({"a": {"b"}, "b": set()}) == set()


def test_no_new_import_cycles() -> None:
    # A cycle (even through an import inside a function) means two modules are one unit that
    # pretends to be two: merge them, or move what both need into a third.
    cycles = import_cycles(import_graph())
    assert sorted(map(sorted, cycles - KNOWN_CYCLES)) == []
    assert sorted(map(sorted, KNOWN_CYCLES - cycles)) == [], "gone: drop it from KNOWN_CYCLES"


def package_of(module: str) -> str:
    """The package a module belongs to for layering: ``posttrain.<component>`` (devenv and
    ctl included), or the top-level module itself (``posttrain.cli``).

    >>> package_of("posttrain.trainer.run.loop"), package_of("posttrain.cli")
    ('posttrain.trainer', 'posttrain.cli')
    """
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages of ours its modules import.

    >>> sorted(package_graph({"p.a.x": {"p.b.y"}, "p.b.y": {"p.b.z"}, "p.b.z": set()}).items())
    [('p.a', {'p.b'}), ('p.b', set())]
    """
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(
            package_of(t) for t in targets if package_of(t) != source
        )
    return packages


def test_no_package_level_import_cycles() -> None:
    # Modules can be acyclic while their packages are not (trainer.run.loop -> envs.training ->
    # trainer.task): then neither package can be understood, tested or shipped without the
    # other. What both need belongs in the lower one.
    graph = import_graph()
    cycles = import_cycles(package_graph(graph))
    edges = {
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        for cycle in cycles
        if package_of(a) in cycle and package_of(b) in cycle and package_of(a) != package_of(b)
    }
    assert sorted(map(sorted, cycles)) == [], sorted(edges)


def private_imports() -> set[str]:
    """``from <our module> import _name`` where the importer is another module."""
    modules = _our_modules()
    found = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            owner = _resolve(target, modules)
            if owner is None or owner == name:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add(f"{name} imports {target}.{alias.name}")
    return found


def test_no_new_private_names_imported_across_modules() -> None:
    # A leading underscore says "only this module relies on it"; another module that needs it
    # needs a public name (or the helper belongs in a module both import).
    found = private_imports()
    assert sorted(found - KNOWN_PRIVATE_IMPORTS) == []
    assert sorted(KNOWN_PRIVATE_IMPORTS - found) == [], "gone: drop it from the known list"


@pytest.mark.parametrize("component", [c for c in COMPONENTS if c != "operator"])
def test_a_component_cannot_be_imported_by_its_folder_name(component: str) -> None:
    # From a checkout's root, ``import storage`` would find the folder itself (posttrain/storage
    # is a symlink to it) and load every module a second time under another name. The
    # component's __init__ refuses, naming the right import. (operator/ has no __init__ and
    # `import operator` is the standard library's.)
    probe = (
        f"import posttrain.{component}\n"
        "try:\n"
        f"    import {component}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported twice')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith(f"import posttrain.{component}, not {component}:"), result


# ------------------------------------------------------------------ function length (#32)

# The rooms where a long function hides several jobs; bench scripts and tests may tell one
# story at length.
LENGTH_BOUNDED = ("operator", "trainer", "rollout", "sandboxes")
MAX_FUNCTION_LINES = 80


def long_functions(source: str, bound: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function (nested ones too) longer than ``bound`` lines,
    decorators aside, docstring included.

    >>> long_functions("def f():\\n    return 1\\n", 1)
    [('f', 2)]
    >>> long_functions("def f():\\n    return 1\\n", 2)
    []
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > bound:
                found.append((node.name, lines))
    return found


def test_the_length_finder_sees_nested_functions() -> None:
    source = "def outer():\n    def inner():\n        a = 1\n        return a\n    return inner\n"
    assert long_functions(source, 3) == [("outer", 5)]
    assert long_functions(source, 2) == [("outer", 5), ("inner", 3)]


def test_no_function_is_longer_than_80_lines() -> None:
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {name} ({lines} lines)"
        for folder in LENGTH_BOUNDED
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for name, lines in long_functions(path.read_text(), MAX_FUNCTION_LINES)
    ]
    assert offenders == [], "split these into named helpers:\n" + "\n".join(offenders)
