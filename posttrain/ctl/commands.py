"""``posttrain apply | get | describe | watch | logs | report``: the user's view.

These commands are thin over the Kubernetes API (the official client, server-side
apply, the events and watch APIs): the cluster is the only source of truth, so what
``posttrain get tr`` shows is what ``kubectl get tr`` shows, with more of the story
(per-domain rewards, eval accuracy, checkpoints) in one table. ``apply`` validates
with the same pydantic models the CRDs are generated from, so a typo is reported
with its field name before anything is sent.

Exit codes: 0 ok, 1 the work failed (not found, rejected, run Failed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from posttrain.api.base import API_VERSION, GROUP, VERSION
from posttrain.api.manifests import parse_resource
from posttrain.ctl.common import (
    cluster_from_args,
    exits_1_on_failure,
    make_console,
    pod_phase,
)
from posttrain.ctl.kube import (
    KINDS,
    TRAINING_RUN,
    Cluster,
    CommandFailed,
    Kind,
    api_failure,
    child_selector,
    kind_by_name,
    resolve_kind,
    server_message,
)
from posttrain.ctl.parsers import FIELD_MANAGER
from posttrain.ctl.render import (
    POOL_HEADERS,
    RUN_HEADERS,
    TASK_HEADERS,
    WARM_POOL_HEADERS,
    build_table,
    describe_children,
    describe_conditions,
    describe_events,
    describe_run_spec,
    describe_run_status,
    format_age,
    pool_row,
    run_row,
    task_row,
    warm_pool_row,
)
from posttrain.errors import UsageError
from posttrain.telemetry import get_tracer

tracer = get_tracer("posttrain.ctl")
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
ROWS = {
    "TrainingRun": (RUN_HEADERS, run_row),
    "RolloutPool": (POOL_HEADERS, pool_row),
    "SandboxTask": (TASK_HEADERS, task_row),
    "SandboxWarmPool": (WARM_POOL_HEADERS, warm_pool_row),
}


# ----------------------------------------------------------------------------- apply


def manifest_files(paths: Iterable[str]) -> list[str]:
    """Expand -f arguments: files as given, directories to their manifests (sorted), - as is."""
    files: list[str] = []
    for entry in paths:
        if entry == "-":
            files.append(entry)
            continue
        path = Path(entry)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES)
            if not found:
                raise UsageError(f"{entry}: directory has no *.yaml, *.yml or *.json manifests")
            files += [str(p) for p in found]
        elif path.is_file():
            files.append(entry)
        else:
            raise UsageError(f"-f {entry}: no such file or directory")
    return files


def read_documents(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, document) for every non-empty YAML document of one file (or stdin)."""
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"{source}: not valid YAML: {exc}") from None
    if not docs:
        raise UsageError(f"{source}: contains no manifest")
    for index, doc in enumerate(docs):
        label = source if len(docs) == 1 else f"{source} (document {index + 1})"
        yield label, doc


def prepare_for_apply(
    doc: dict[str, Any], label: str, namespace_flag: str | None
) -> tuple[Kind, dict[str, Any]]:
    """Validate one document and return the body to apply (what the user wrote, no status).

    The user's own fields are sent rather than the model's dump with defaults filled in,
    so the ``posttrain`` field manager owns only what the user set (as kubectl does) and
    the apiserver's schema defaulting stays the single source of defaults. The namespace is
    the document's, else -n; with neither it is left for the kubeconfig context to fill.
    """
    parse_resource(doc, label)  # raises UsageError naming every bad field
    kind = kind_by_name(doc["kind"])
    meta = dict(doc.get("metadata") or {})
    declared = meta.get("namespace")
    if declared and namespace_flag and declared != namespace_flag:
        raise UsageError(
            f"{label}: metadata.namespace is {declared!r} but -n says {namespace_flag!r}; "
            "drop one of them"
        )
    if declared or namespace_flag:
        meta["namespace"] = declared or namespace_flag
    body = {k: v for k, v in doc.items() if k != "status"}
    body["metadata"] = meta
    return kind, body


@exits_1_on_failure
def apply_command(args: argparse.Namespace) -> int:
    """Validate everything before connecting; apply only when every document is valid."""
    files = manifest_files(args.filename)
    documents = [item for source in files for item in read_documents(source)]
    problems: list[str] = []
    prepared: list[tuple[Kind, dict[str, Any]]] = []
    for label, doc in documents:
        try:
            prepared.append(prepare_for_apply(doc, label, args.namespace))
        except UsageError as exc:
            problems.append(str(exc))
    if problems:
        raise UsageError("\n".join(problems) + "\nnothing was applied")
    cluster = cluster_from_args(args)
    for _, body in prepared:
        body["metadata"].setdefault("namespace", cluster.namespace)
    failures = 0
    for kind, body in prepared:
        try:
            print(apply_one(cluster, kind, body, args.dry_run, args.force_conflicts))
        except CommandFailed as exc:
            failures += 1
            print(f"error: {exc}", file=sys.stderr)
    return 1 if failures else 0


def apply_one(
    cluster: Cluster, kind: Kind, body: dict[str, Any], dry_run: bool, force: bool
) -> str:
    """Server-side apply one object; returns kubectl's ``kind.group/name created|configured``."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    with tracer.start_as_current_span("ctl.apply") as span:
        span.set_attribute("posttrain.kind", kind.kind)
        span.set_attribute("posttrain.name", name)
        span.set_attribute("posttrain.namespace", namespace)
        before = _live_object(cluster, kind, name, namespace)
        try:
            after = cluster.custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                kind.plural,
                name,
                body,
                field_manager=FIELD_MANAGER,
                force=force,
                dry_run="All" if dry_run else None,
                _content_type="application/apply-patch+yaml",
            )
        except Exception as exc:
            from kubernetes.client.rest import ApiException

            if isinstance(exc, ApiException) and exc.status == 409:
                raise CommandFailed(
                    f"{kind.qualified}/{name}: conflict with another field manager: "
                    f"{server_message(exc)}; re-run with --force-conflicts to take over"
                ) from None
            if isinstance(exc, ApiException) and exc.status in (400, 422):
                raise CommandFailed(
                    f"{kind.qualified}/{name} rejected by the apiserver: {server_message(exc)}"
                ) from None
            raise api_failure(exc, f"{kind.qualified}/{name}") from None
        if before is None:
            verb = "created"
        elif user_content(after) == user_content(before):
            verb = "unchanged"
        else:
            verb = "configured"
        span.set_attribute("posttrain.result", verb)
    return f"{kind.qualified}/{name} {verb}" + (" (server dry run)" if dry_run else "")


def _live_object(cluster: Cluster, kind: Kind, name: str, namespace: str) -> dict[str, Any] | None:
    """The object as it is now, None when it does not exist yet."""
    from kubernetes.client.rest import ApiException

    try:
        return cluster.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, namespace, kind.plural, name
        )
    except ApiException as exc:
        if exc.status == 404 and "could not find the requested resource" not in str(exc.body):
            return None
        raise api_failure(exc, f"{kind.qualified}/{name}") from None
    except Exception as exc:
        raise api_failure(exc, f"{kind.qualified}/{name}") from None


def user_content(obj: dict[str, Any]) -> tuple[Any, Any, Any]:
    """What an apply can change: spec, labels, annotations. Compared rather than the
    resourceVersion because a server dry run never moves the resourceVersion.

    >>> user_content({"spec": {"a": 1}, "metadata": {"resourceVersion": "7"}})
    ({'a': 1}, {}, {})
    """
    meta = obj.get("metadata", {})
    return obj.get("spec"), meta.get("labels") or {}, meta.get("annotations") or {}


# ----------------------------------------------------------------------------- get


@exits_1_on_failure
def get_command(args: argparse.Namespace) -> int:
    kinds = KINDS if args.kind == "all" else (resolve_kind(args.kind),)
    if args.name and args.kind == "all":
        raise UsageError(f"a name ({args.name!r}) needs a resource type: posttrain get tr NAME")
    if args.name and args.all_namespaces:
        raise UsageError("-A lists every namespace; give -n NAMESPACE to get one object by name")
    cluster = cluster_from_args(args)
    if args.name:
        objects = {kinds[0].kind: [cluster.get(kinds[0], args.name)]}
    else:
        objects = {k.kind: cluster.list(k, args.all_namespaces) for k in kinds}
    if args.output != "table":
        print(serialize(objects, single=bool(args.name), output=args.output))
        return 0
    print_tables(objects, args.all_namespaces, cluster.namespace)
    return 0


def serialize(objects: dict[str, list[dict[str, Any]]], single: bool, output: str) -> str:
    """JSON/YAML like kubectl: the object itself for one name, else a v1 List; managedFields
    are left out (as kubectl does) because they bury the spec under bookkeeping."""
    items = [without_managed_fields(obj) for group in objects.values() for obj in group]
    document: Any = items[0] if single else {"apiVersion": "v1", "kind": "List", "items": items}
    if output == "json":
        return json.dumps(document, indent=2, sort_keys=False)
    return yaml.safe_dump(document, sort_keys=False).rstrip()


def without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` without metadata.managedFields.

    >>> without_managed_fields({"metadata": {"name": "a", "managedFields": []}})
    {'metadata': {'name': 'a'}}
    """
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def print_tables(
    objects: dict[str, list[dict[str, Any]]], all_namespaces: bool, namespace: str
) -> None:
    console = make_console()
    now = datetime.now(UTC)
    printed = False
    for kind_name, items in objects.items():
        if not items:
            continue
        headers, row = ROWS[kind_name]
        if len(objects) > 1:  # `get all`: say which table is which, as kubectl does
            if printed:
                console.print()
            console.print(f"[bold]{kind_by_name(kind_name).qualified}[/]")
        namespaces = [o["metadata"].get("namespace", "") for o in items] if all_namespaces else None
        console.print(build_table(headers, [row(o, now) for o in items], namespaces))
        printed = True
    if not printed:
        where = "any namespace" if all_namespaces else f"namespace {namespace!r}"
        print(f"No resources found in {where}.", file=sys.stderr)


# ----------------------------------------------------------------------------- describe


@exits_1_on_failure
def describe_command(args: argparse.Namespace) -> int:
    kind = resolve_kind(args.kind)
    cluster = cluster_from_args(args)
    obj = cluster.get(kind, args.name)
    console = make_console()
    for line in describe_lines(cluster, kind, obj, datetime.now(UTC)):
        console.print(line, markup=False, highlight=False)
    return 0


def describe_lines(cluster: Cluster, kind: Kind, obj: dict[str, Any], now: datetime) -> list[str]:
    """Every section of ``describe`` for one object, as text lines."""
    meta, spec, status = obj["metadata"], obj.get("spec", {}), obj.get("status") or {}
    created = meta.get("creationTimestamp")
    lines = [
        f"Name:         {meta['name']}",
        f"Namespace:    {meta.get('namespace', '')}",
        f"Kind:         {kind.kind} ({API_VERSION})",
        f"Created:      {created} ({format_age(created, now)} ago)",
        f"Generation:   {meta.get('generation')} "
        f"(observed: {status.get('observedGeneration', '-')})",
    ]
    if kind is TRAINING_RUN:
        lines += ["", "Spec:", *indent(describe_run_spec(spec))]
        lines += ["", "Status:", *indent(describe_run_status(status))]
    else:
        lines += ["", "Spec:", *indent(yaml.safe_dump(spec, sort_keys=False).splitlines())]
        figures = {k: v for k, v in status.items() if k != "conditions"}
        lines += ["", "Status:", *indent(yaml.safe_dump(figures, sort_keys=False).splitlines())]
    lines += ["", "Conditions:", *describe_conditions(status.get("conditions", []), now)]
    lines += ["", "Events:", *describe_events(object_events(cluster, kind, obj), now)]
    children = children_of(cluster, kind, obj, now)
    selector = child_selector(kind, meta["name"])
    lines += ["", "Children:", *describe_children(children, selector)]
    return lines


def indent(lines: list[str], prefix: str = "  ") -> list[str]:
    return [prefix + line for line in lines]


def object_events(cluster: Cluster, kind: Kind, obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Events about this object (involvedObject filter), skipping a same-named predecessor's."""
    meta = obj["metadata"]
    selector = f"involvedObject.name={meta['name']},involvedObject.kind={kind.kind}"
    try:
        result = cluster.core.list_namespaced_event(
            meta["namespace"], field_selector=selector, _preload_content=False
        )
    except Exception as exc:
        raise api_failure(exc, f"events of {kind.singular} {meta['name']!r}") from None
    if result.status >= 400:  # an unparsed response is not raised as an ApiException
        raise CommandFailed(
            f"events of {kind.singular} {meta['name']!r}: the apiserver said {result.status} "
            f"{result.reason}"
        )
    # Plain dicts (camelCase, as kubectl -o json shows them) feed the pure renderers.
    events = json.loads(result.data).get("items", [])
    uid = meta.get("uid")
    return [
        e for e in events if not e["involvedObject"].get("uid") or e["involvedObject"]["uid"] == uid
    ]


def children_of(
    cluster: Cluster, kind: Kind, obj: dict[str, Any], now: datetime
) -> list[tuple[str, str, str, str]]:
    """(kind, name, phase, age) of the pods and jobs labelled as this object's."""
    meta = obj["metadata"]
    selector = child_selector(kind, meta["name"])
    rows: list[tuple[str, str, str, str]] = []
    try:
        jobs = cluster.batch.list_namespaced_job(meta["namespace"], label_selector=selector)
        pods = cluster.core.list_namespaced_pod(meta["namespace"], label_selector=selector)
    except Exception as exc:
        raise api_failure(exc, f"children of {kind.singular} {meta['name']!r}") from None
    for job in jobs.items:
        rows.append(("Job", job.metadata.name, job_phase(job), _age(job.metadata, now)))
    for pod in pods.items:
        rows.append(("Pod", pod.metadata.name, pod_phase(pod), _age(pod.metadata, now)))
    return rows


def _age(metadata: Any, now: datetime) -> str:
    created = metadata.creation_timestamp
    return format_age(created.isoformat() if created else None, now)


def job_phase(job: Any) -> str:
    """Complete / Failed (with reason) / Active N / Pending, from the Job's status."""
    status = job.status
    for cond in status.conditions or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed", "Suspended"):
            return cond.type + (f" ({cond.reason})" if cond.reason else "")
    if status.active:
        return f"Active {status.active}"
    return "Pending"
