"""Moved to :mod:`posttrain.api.reasons` (beside the Condition model); this name stays for
imports on branches in flight."""

from __future__ import annotations

from posttrain.api.reasons import ConditionType, Reason, SandboxExitReason

__all__ = ["ConditionType", "Reason", "SandboxExitReason"]
