"""Building blocks shared by every posttrain resource: the camelCase model base,
metav1-style conditions, and the group/version constants.

This module depends on nothing but pydantic, so every component (operator,
trainer, sandboxes, CLI) can import it without pulling in the others.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "posttrain.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# A Kubernetes object name (RFC 1123 label): what we use for domain, pool and run names.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A resource quantity such as "500m", "2", "8Gi" (the apiserver's own grammar, simplified).
QUANTITY = r"^([0-9]+(\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class ApiModel(BaseModel):
    """Base for every API type: snake_case in Python, camelCase on the wire.

    ``extra="forbid"`` makes a typo in a local YAML fail the same way the
    apiserver's structural schema prunes-and-rejects it; attribute docstrings
    become the OpenAPI descriptions that ``kubectl explain`` shows.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict sent to the apiserver (unset optional fields omitted)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One observation of the object's state, in metav1.Condition form."""

    type: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9]*$", max_length=316)
    """CamelCase condition type, e.g. Ready, Suspended, Failed."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    """A fixed CamelCase reason constant (see the Reason classes); machines switch on it."""
    message: str = Field(default="", max_length=32768)
    """Human-readable details: what happened and what to do."""
    last_transition_time: datetime
    """When status last changed (not when it was last confirmed)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this condition was computed from."""


# Conditions are a map keyed on type (server-side apply merges them per type).
CONDITIONS_FIELD: Any = Field(
    default_factory=list,
    description="Latest observations of the object's state, one per type.",
    json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
)


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    observed_generation: int | None = None,
) -> list[Condition]:
    """Return ``conditions`` with ``type_`` set; lastTransitionTime moves only on a status change.

    >>> c = set_condition([], "Ready", "False", "Pending")
    >>> c2 = set_condition(c, "Ready", "False", "StillPending", "waiting")
    >>> c2[0].last_transition_time == c[0].last_transition_time
    True
    """
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        found = True
        changed = cond.status != status
        out.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now() if changed else cond.last_transition_time,
                observed_generation=observed_generation,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now(),
                observed_generation=observed_generation,
            )
        )
    return out


def get_condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta that posttrain reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63)
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None
