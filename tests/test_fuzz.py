"""Fuzzing (hypothesis, derandomized and bounded): what clients send the two HTTP APIs and what
users apply as manifests ends in a result or a clear client error, never a crash.

* rollout servers (``posttrain serve``, the vLLM front door): every body either parses or is
  an :class:`ApiError` with a 4xx status, and the server answers exactly that status;
* sandbox runner: every ``POST /v1/exec`` body parses or is a 4xx :class:`BadRequest`;
* manifests: any decoded object or YAML text is a resource or a :class:`UsageError`.

``derandomize=True``: the examples are a fixed function of the test, so CI sees the same ones
on every run (a fuzz test that passes or fails by luck is not a test); ``max_examples`` bounds
the time to seconds.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from posttrain.api import parse_resource
from posttrain.api.base import API_VERSION
from posttrain.api.manifests import KINDS, load_manifests
from posttrain.errors import UsageError
from posttrain.rollout.limits import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    WeightLoadRequest,
    WeightTransferRequest,
    check_limits,
    parse_body,
)
from posttrain.sandboxes.runner import BadRequest, parse_exec_request

FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)


def objects_with(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects using the model's own field names (so parsing gets past the first check)
    with arbitrary values, plus a stray key now and then."""
    return st.fixed_dictionaries(
        {}, optional={**{key: json_values for key in keys}, "stray": json_values}
    )


def field_names(model: Any) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def bodies(model: Any) -> st.SearchStrategy[bytes]:
    """Raw request bodies: JSON of the model's shape (NaN and Infinity included, as Python's
    json module writes them), other JSON, and bytes that are no JSON at all."""
    return (
        objects_with(field_names(model)).map(lambda o: json.dumps(o).encode())
        | json_values.map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=64)
    )


REQUESTS = {
    "completions": CompletionRequest,
    "chat": ChatRequest,
    "load": WeightLoadRequest,
    "transfer": WeightTransferRequest,  # the vLLM front door's only
}


@pytest.mark.parametrize("kind", REQUESTS)
@FUZZ
@given(data=st.data())
def test_rollout_bodies_parse_or_are_a_4xx(kind: str, data: st.DataObject) -> None:
    model = REQUESTS[kind]
    body = data.draw(bodies(model))
    try:
        request = parse_body(model, body)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message, (body, exc.status)
        return
    if isinstance(request, CompletionRequest | ChatRequest):
        try:
            check_limits(request, RequestLimits(), context_length=2048)
        except ApiError as exc:
            assert 400 <= exc.status < 500 and exc.param, (body, exc.message)


def _cpu_app() -> Any:
    from fastapi.testclient import TestClient

    from posttrain.rollout.server import ServerConfig, ServerState, create_app

    state = ServerState(ServerConfig(model="stand-in"))
    state.engine = SimpleNamespace(max_positions=2048, weight_version=0)
    state.ready.set()
    return TestClient(create_app(state))


def _front_door() -> Any:
    from fastapi.testclient import TestClient

    from posttrain.rollout.vllm import VllmFrontDoor

    door = VllmFrontDoor("http://127.0.0.1:9", None, "/tmp", context_length=2048)
    door.ready = True
    return TestClient(door.create_app())


PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "load": "/v1/weights/load",
    "transfer": "/v1/weights/transfer",
}


@pytest.mark.parametrize(
    ("server", "kind"),
    [(s, k) for s in ("cpu", "vllm") for k in REQUESTS if (s, k) != ("cpu", "transfer")],
)
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_servers_answer_a_refused_body_with_its_4xx(
    server: str, kind: str, data: st.DataObject
) -> None:
    body = data.draw(bodies(REQUESTS[kind]))
    try:
        request = parse_body(REQUESTS[kind], body)
        if isinstance(request, CompletionRequest | ChatRequest):
            check_limits(request, RequestLimits(), context_length=2048)
        assume(False)  # a valid body would reach the (absent) engine: not this test's concern
    except ApiError as exc:
        expected = exc.status
    client = _cpu_app() if server == "cpu" else _front_door()
    response = client.post(PATHS[kind], content=body, headers={"content-type": "application/json"})
    assert response.status_code == expected, (body, response.text)
    assert response.json()["error"]["message"]


EXEC_FIELDS = [
    "command", "stdin", "files", "env", "timeout_s", "memory_mb", "network", "cpu_time_s",
    "max_processes", "max_file_mb", "workdir_mb", "max_output_bytes", "workspace_tar",
    "capture_workspace",
]  # ExecRequest's fields and the workspace options  # fmt: skip


@FUZZ
@given(
    body=objects_with(EXEC_FIELDS).map(lambda o: json.dumps(o).encode()) | st.binary(max_size=64)
)
def test_sandbox_exec_bodies_parse_or_are_a_4xx(body: bytes) -> None:
    try:
        parse_exec_request(body)
    except BadRequest as exc:
        assert 400 <= exc.status < 500 and str(exc), body


@FUZZ
@given(kind=st.sampled_from(sorted(KINDS)), data=st.data())
def test_manifests_are_a_resource_or_a_usage_error(kind: str, data: st.DataObject) -> None:
    spec_model = KINDS[kind].model_fields["spec"].annotation
    spec = data.draw(objects_with(field_names(spec_model)) | json_values)
    metadata = data.draw(st.fixed_dictionaries({"name": st.text(max_size=12)}) | json_values)
    manifest = {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}
    try:
        parse_resource(manifest)
    except UsageError as exc:
        assert str(exc)


@FUZZ
@given(text=st.text(max_size=200))
def test_manifest_files_load_or_are_a_usage_error(text: str, tmp_path_factory: Any) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "m.yaml"
    path.write_text(text)
    try:
        load_manifests(path)
    except UsageError as exc:
        assert str(exc)
