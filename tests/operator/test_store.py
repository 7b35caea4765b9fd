"""The operator's cache never goes back in time, not even across a removal.

Pod events are cached on worker threads, so a pod's DELETED event (or the operator's own
delete) can be applied before an older MODIFIED event of the same pod. Without a tombstone
that stale event re-added the pod as live, and nothing ever removed it again: a resumed
multi-node run then saw "plain pods still running" and started its gang on the wrong path.
"""

from __future__ import annotations

from typing import Any

from posttrain.operator.shared.state import Store


def pod(name: str, rv: int, uid: str = "u1", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": uid,
        "resourceVersion": str(rv),
        "labels": {"posttrain.io/run": "r"},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def test_an_event_older_than_the_deletion_does_not_bring_the_pod_back() -> None:
    store = Store("posttrain.io/run")
    assert store.put(pod("p", 10))
    store.remove("ns", "p", last=pod("p", 12))  # the DELETED event, applied first
    assert not store.put(pod("p", 11))  # the MODIFIED event, applied late
    assert store.get("ns", "p") is None
    assert store.children("ns", "r") == []


def test_the_operators_own_delete_leaves_a_tombstone_at_the_cached_version() -> None:
    store = Store("posttrain.io/run")
    store.put(pod("p", 10))
    store.remove("ns", "p")  # after kube.delete: no final body known
    assert not store.put(pod("p", 10))  # the echo of an event it had already seen
    # A later version (graceful deletion marks the pod deleting) is news, and kept.
    assert store.put(pod("p", 13, deleting=True))
    assert store.get("ns", "p") is not None


def test_a_new_object_with_the_same_name_is_not_hidden_by_the_old_ones_tombstone() -> None:
    store = Store("posttrain.io/run")
    store.put(pod("p", 10, uid="old"))
    store.remove("ns", "p", last=pod("p", 20, uid="old"))
    assert store.put(pod("p", 15, uid="new"))  # a recreated pod, another uid
    assert store.children("ns", "r")[0]["metadata"]["uid"] == "new"
