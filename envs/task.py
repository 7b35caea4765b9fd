"""The task record: one prompt plus what its verifier checks against.

Its own module, below everything that reads or makes tasks: the trainer's datasets (which
also list the environments' built-in tasks) and the environments (which play them) meet here.
It lives in ``envs/``, the lower of the two packages, so the environments never import the
trainer (tests/test_layers.py forbids package-level cycles).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One prompt plus what its verifier checks against."""

    domain: str
    prompt: str
    answer: str | None = None
    tests: str | None = None
    difficulty: str = "default"
    verifier: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        """Stable id of the *question* (domain + prompt): the unit of the held-out split, so
        one prompt can never sit on both sides even with different tests or answers."""
        return content_hash(self.domain, self.prompt)[:16]

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (the same shape a task file line has)."""
        record = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        record.update(self.extra)
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Task:
        known = {"domain", "prompt", "answer", "tests", "difficulty", "verifier"}
        extra = {k: v for k, v in record.items() if k not in known}
        return cls(
            domain=str(record["domain"]),
            prompt=str(record["prompt"]),
            answer=None if record.get("answer") is None else str(record["answer"]),
            tests=record.get("tests"),
            difficulty=str(record.get("difficulty", "default")),
            verifier=record.get("verifier"),
            extra=extra,
        )


def content_hash(*parts: str) -> str:
    """sha256 of the parts joined by NUL.

    >>> content_hash("a", "b")[:8]
    '59b271ae'
    """
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()
