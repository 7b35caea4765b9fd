"""spec.sandbox as the trainer uses it, against real sandboxes: the bubblewrap executor and a
real runner server over HTTP (uvicorn in a thread), stopped and restarted to make outages.

An execution the sandbox could not perform is retried and counted, never scored; one that
keeps failing fails the step with the sandbox's name. Rewards do not depend on the mode.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import uvicorn

from posttrain.api.trainingrun import SandboxPolicy
from posttrain.sandboxes.executor import ExecRequest, Executor, SandboxError
from posttrain.sandboxes.runner import create_app
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.rewards.scoring import VerificationUnavailable, score_samples
from posttrain.trainer.rewards.verification import (
    INFRA_FAILURES,
    CappedRunner,
    SandboxHealth,
    build_verification,
)

TESTS = (
    "def test_add():\n    assert add(2, 3) == 5\n\ndef test_neg():\n    assert add(-1, 1) == 0\n"
)
TASK = {"tests": TESTS}
COMPLETIONS = [
    "```python\ndef add(a, b):\n    return a + b\n```",  # right
    "```python\ndef add(a, b):\n    return a - b\n```",  # wrong
    "```python\ndef add(a, b):\n    return 5 if a == 2 else 1\n```",  # half right
    "```python\nimport sys\nsys.exit(0)\n```",  # exits before the tests
    "no code at all",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def runner_on(port: int) -> Iterator[str]:
    """A real runner (`posttrain sandbox serve`'s app) on ``port`` until the block ends."""
    executor = Executor()
    app = create_app(executor, concurrency=2, max_queue=16)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            loop="asyncio",
            http="h11",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "runner did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        executor.close()


def wait_until(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_runner_mode_scores_exactly_as_the_local_executor() -> None:
    local = build_verification(SandboxPolicy(mode="local"))
    with runner_on(free_port()) as url:
        remote = build_verification(SandboxPolicy(mode="runner", runner_url=url))
        with ThreadPoolExecutor(2) as pool:
            here = list(pool.map(lambda c: local.verify("unit_tests", c, TASK, {}), COMPLETIONS))
            there = list(pool.map(lambda c: remote.verify("unit_tests", c, TASK, {}), COMPLETIONS))
    assert [r.reward for r in here] == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert [(r.reward, r.passed) for r in there] == [(r.reward, r.passed) for r in here]
    assert [r.details["hack_signals"] for r in there] == [r.details["hack_signals"] for r in here]
    assert remote.health == SandboxHealth("runner", url)  # nothing failed


def test_an_outage_mid_run_is_retried_and_the_sample_scored_when_the_runner_is_back() -> None:
    port = free_port()
    seen: list[SandboxHealth] = []
    before = INFRA_FAILURES.labels("runner")._value.get()
    with runner_on(port) as url:
        verification = build_verification(
            SandboxPolicy(mode="runner", runner_url=url, unavailable_timeout_seconds=600),
            on_health=seen.append,
        )
        assert verification.verify("unit_tests", COMPLETIONS[0], TASK, {}).reward == 1.0
    # The runner is gone: the verification waits instead of scoring a 0.
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(verification.verify, "unit_tests", COMPLETIONS[0], TASK, {})
        wait_until(lambda: not verification.health.available, "the outage to be noticed")
        assert not pending.done()
        with runner_on(port):  # back, on the same address
            result = pending.result(timeout=300)
    assert (result.reward, result.passed) == (1.0, True)
    assert verification.health.available and verification.health.infra_failures >= 1
    assert url in (verification.health.last_error or "")
    assert [h.available for h in seen][:1] == [False] and seen[-1].available
    assert INFRA_FAILURES.labels("runner")._value.get() >= before + 1


def test_a_runner_url_that_does_not_answer_fails_the_step_naming_it_never_a_zero() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    seen: list[SandboxHealth] = []
    verification = build_verification(
        SandboxPolicy(mode="runner", runner_url=url, unavailable_timeout_seconds=1),
        on_health=seen.append,
    )
    task = Task("code", "write add", tests=TESTS)
    with pytest.raises(VerificationUnavailable, match=url):
        score_samples(
            [COMPLETIONS[0]],
            [10],
            [task],
            {"code": ("unit_tests", {})},
            max_new_tokens=64,
            overlong_buffer=0,
            overlong_penalty_value=0.0,
            verify=verification.verify,
        )
    assert seen and not seen[-1].available and url in (seen[-1].last_error or "")


def test_a_broken_task_still_scores_zero_but_a_broken_sandbox_raises() -> None:
    task = Task("code", "write add")  # no "tests": the task is at fault, not the sandbox

    def sandbox_down(*_: Any) -> Any:
        raise SandboxError("bwrap: setting up uid map: Permission denied")

    kwargs: dict[str, Any] = {
        "max_new_tokens": 64,
        "overlong_buffer": 0,
        "overlong_penalty_value": 0.0,
    }
    scored = score_samples(
        [COMPLETIONS[0]],
        [10],
        [task],
        {"code": ("unit_tests", {})},
        verify=build_verification(SandboxPolicy()).verify,
        **kwargs,
    )
    assert scored[0].reward == 0.0 and "tests" in scored[0].details["error"]
    with pytest.raises(SandboxError):
        score_samples(
            [COMPLETIONS[0]],
            [10],
            [task],
            {"code": ("unit_tests", {})},
            verify=sandbox_down,
            **kwargs,
        )


def test_the_policy_caps_every_request() -> None:
    seen: list[ExecRequest] = []

    class Recorder:
        def run(self, request: ExecRequest) -> None:
            seen.append(request)

    capped = CappedRunner(Recorder, timeout_s=3.0, memory_mb=256)
    capped.run(ExecRequest(["true"], timeout_s=60.0, memory_mb=1024))
    capped.run(ExecRequest(["true"], timeout_s=1.0, memory_mb=64))
    assert [(r.timeout_s, r.memory_mb) for r in seen] == [(3.0, 256), (1.0, 64)]


def test_runner_mode_without_any_runner_is_a_clear_error() -> None:
    from posttrain.api.env import TrainerEnv
    from posttrain.errors import UsageError

    with pytest.raises(UsageError, match="runnerUrl"):
        build_verification(SandboxPolicy(mode="runner"), contract=TrainerEnv())
    with pytest.raises(UsageError, match="POSTTRAIN_RUN_NAMESPACE"):
        build_verification(SandboxPolicy(mode="task"), contract=TrainerEnv())
