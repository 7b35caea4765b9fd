"""The operator -> pod environment contract (posttrain/api/env.py): one place for the names,
models that write and parse them, and no ``POSTTRAIN_`` name spelled anywhere else."""

from __future__ import annotations

import ast
import doctest
import re
import sys
from pathlib import Path

import pytest

from posttrain.api import env
from posttrain.api.env import RolloutPoolEnv, SandboxTaskEnv, TrainerEnv, WarmPoolEnv
from posttrain.errors import UsageError


def test_docstring_examples_hold() -> None:
    for module in (env, sys.modules[__name__]):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


def _as_environ(entries: list[dict[str, str]]) -> dict[str, str]:
    return {entry["name"]: entry["value"] for entry in entries}


@pytest.mark.parametrize(
    "model",
    [
        TrainerEnv(
            run_name="r1",
            run_namespace="team",
            run_uid="0b6f",
            master_addr="r1-head.team.svc",
            master_port=29500,
            world_size=2,
            rank=1,
            node_rank=1,
            gang=3,
            sandbox_runner_url="http://r1-sandbox.team.svc:8080",
            rollout_endpoints=["http://gen.team.svc:8011", "http://gen2.team.svc:8011"],
            rollout_pool="gen",
            rollout_dtype="bfloat16",
            ray_address="head:6379",
        ),
        TrainerEnv(),
        RolloutPoolEnv(pool_name="gen", weights_uri="s3://b/w", weights_poll_seconds=2.5),
        SandboxTaskEnv(task="t1", attempt=2, workdir="/w", timeout_seconds=30, logs_url="u"),
        WarmPoolEnv(workdir="/w", claim_file="/etc/claim/claim"),
    ],
)
def test_what_the_operator_writes_the_pod_parses_back(model: env.PodEnv) -> None:
    assert type(model).from_env(_as_environ(model.to_env())) == model


def test_every_variable_is_a_declared_name() -> None:
    # The models spell no name of their own: each field's variable is one of the constants.
    declared = {value for value in vars(env).values() if isinstance(value, str)}
    for model in (TrainerEnv, RolloutPoolEnv, SandboxTaskEnv, WarmPoolEnv):
        for field in model.model_fields:
            assert model.variable(field) in declared, (model.__name__, field)


def test_a_missing_required_variable_is_named() -> None:
    with pytest.raises(UsageError, match=r"\$POSTTRAIN_SANDBOX_TASK \(unset\): Field required"):
        SandboxTaskEnv.from_env({})


def test_a_malformed_value_is_named_with_its_value() -> None:
    with pytest.raises(UsageError, match=r"\$MASTER_PORT='p'.*\$POSTTRAIN_GANG='x'"):
        TrainerEnv.from_env({"POSTTRAIN_GANG": "x", "MASTER_PORT": "p"})


def test_empty_means_unset_and_defaults_hold() -> None:
    parsed = TrainerEnv.from_env({"POSTTRAIN_NODE_RANK": "", "POSTTRAIN_ROLLOUT_ENDPOINTS": " "})
    assert (parsed.node_rank, parsed.gang, parsed.rollout_endpoints) == (0, 0, [])
    assert TrainerEnv.from_env({}) == TrainerEnv()


def test_the_stdlib_entrypoints_copies_of_the_names_agree() -> None:
    # task_entrypoint.py and warm_entrypoint.py run in the task's own image with the stdlib
    # only (the operator ships their source), so they keep copies of the names they read.
    from posttrain.operator.warmpool import entrypoint as warm_entrypoint
    from posttrain.sandboxes import task_entrypoint

    assert task_entrypoint.WORKDIR_ENV == env.SANDBOX_WORKDIR
    assert task_entrypoint.RESULT_PATH_ENV == env.SANDBOX_RESULT_PATH
    assert task_entrypoint.TIMEOUT_ENV == env.SANDBOX_TIMEOUT
    assert task_entrypoint.LOG_LIMIT_ENV == env.SANDBOX_LOG_LIMIT
    assert task_entrypoint.LOGS_URL_ENV == env.SANDBOX_LOGS_URL
    assert task_entrypoint.SNAPSHOT_URL_ENV == env.SANDBOX_SNAPSHOT_URL
    assert task_entrypoint.RESTORE_URL_ENV == env.SANDBOX_RESTORE_URL
    assert warm_entrypoint.CLAIM_FILE_ENV == env.WARM_CLAIM_FILE
    assert warm_entrypoint.WORKDIR_ENV == env.WARM_WORKDIR
    assert warm_entrypoint.TASK_ENV == env.SANDBOX_TASK
    assert warm_entrypoint.ATTEMPT_ENV == env.SANDBOX_ATTEMPT


# ------------------------------------------------------------------ no name spelled twice

REPO_ROOT = Path(__file__).resolve().parents[2]
# Every folder of posttrain's package (the components are symlinked into posttrain/).
SOURCE_FOLDERS = ("operator", "trainer", "rollout", "sandboxes", "storage", "envs", "posttrain")
# Shipped as source into the task's own image, stdlib only: they keep copies (checked above).
STDLIB_COPIES = {"sandboxes/task_entrypoint.py", "operator/warmpool/entrypoint.py"}
NAME = re.compile(r"(?<![A-Za-z0-9_])POSTTRAIN_[A-Z0-9_]*")


def _documentation(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements: docstrings, attribute
    docstrings (documentation may name variables; code that uses a name is an expression)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def spelled_names(source: str) -> list[str]:
    """The ``POSTTRAIN_`` names a module spells in string literals (f-strings included),
    docstrings and comments aside.

    >>> spelled_names('x = "POSTTRAIN_A"\\ny = f"set $POSTTRAIN_B={1}"\\nz = "__POSTTRAIN_C__"')
    ['POSTTRAIN_A', 'POSTTRAIN_B']
    >>> spelled_names('def f():\\n    "docs may say $POSTTRAIN_A"\\n# and comments POSTTRAIN_B')
    []
    """
    tree = ast.parse(source)
    documentation = _documentation(tree)
    found = []
    for node in ast.walk(tree):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and id(node) not in documentation:
            found += NAME.findall(node.value)
    return found


def test_the_literal_finder_sees_strings_and_skips_documentation() -> None:
    assert spelled_names('x = "POSTTRAIN_A"') == ["POSTTRAIN_A"]
    assert spelled_names('x = "a " "POSTTRAIN_B"') == ["POSTTRAIN_B"]
    assert spelled_names('"""module docs: $POSTTRAIN_A"""') == []


def test_no_environment_name_is_spelled_outside_the_contract() -> None:
    # A name spelled twice drifts apart silently: import it from posttrain.api.env.
    offenders = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(REPO_ROOT))
            if relative in STDLIB_COPIES:
                continue
            for name in spelled_names(path.read_text()):
                offenders.append(f"{relative}: {name}")
    assert offenders == []
