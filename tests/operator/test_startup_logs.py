"""A healthy operator start logs no WARNING or ERROR: kopf's retried 429 while a CRD's watch
cache fills is INFO, and real problems keep their level."""

from __future__ import annotations

import logging

from posttrain.operator.settings import _ExpectedAtStartup


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_expected_start_up_lines_become_info_and_real_problems_stay() -> None:
    keep = _ExpectedAtStartup()
    retry = record(
        "kopf._cogs.clients.watching",
        logging.ERROR,
        "Request attempt #1/9 failed; will retry: GET https://x/apis/kopf.dev/v1/namespaces/ns"
        "/kopfpeerings -> APITooManyRequestsError('storage is (re)initializing')",
    )
    assert keep.filter(retry) and retry.levelno == logging.INFO

    escalated = record(
        "kopf._cogs.clients.watching",
        logging.ERROR,
        "Request attempt #9/9 failed; escalating: GET x -> APIServerError()",
    )
    ours_missing = record(
        "kopf._core.reactor.observation",
        logging.WARNING,
        "Unresolved resources cannot be served (try creating their CRDs): "
        "Selector(group='posttrain.io', version='v1alpha1', "
        "any_name='trainingruns')",
    )
    for real in (escalated, ours_missing):
        level = real.levelno
        assert keep.filter(real) and real.levelno == level
