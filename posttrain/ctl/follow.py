"""``posttrain watch tr NAME`` and ``posttrain logs tr NAME``: following a run as it goes.

``watch`` is fed by the Kubernetes watch API (one long request; the apiserver pushes every
status patch), not by polling, so a step shows the moment the trainer reports it and an
idle run costs the apiserver nothing. ``logs`` finds the trainer pod by the operator's
labels and streams it, saying plainly when there is no pod to read yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from posttrain.api.base import GROUP, VERSION
from posttrain.api.labels import LABEL_GANG, LABEL_RANK
from posttrain.ctl.common import (
    cluster_from_args,
    exits_1_on_failure,
    fail,
    make_console,
    pod_phase,
)
from posttrain.ctl.kube import (
    TRAINER_CONTAINER,
    TRAINING_RUN,
    Cluster,
    CommandFailed,
    api_failure,
    resolve_kind,
    trainer_selector,
)
from posttrain.ctl.render import format_domains, format_step, watch_headers, watch_row
from posttrain.errors import UsageError
from posttrain.telemetry import get_tracer

tracer = get_tracer("posttrain.ctl")
TERMINAL_PHASES = {"Succeeded": 0, "Failed": 1}
WATCH_CHUNK_S = 60  # the apiserver closes each watch after this long; we reconnect


def require_run_kind(word: str, command: str) -> None:
    """watch/logs only make sense for TrainingRuns; say so instead of doing something odd."""
    if resolve_kind(word) is not TRAINING_RUN:
        raise UsageError(f"`posttrain {command}` follows TrainingRuns only (tr), not {word!r}")


# ----------------------------------------------------------------------------- watch


class WatchView:
    """The rows ``watch`` shows: one per distinct reported state, in a Live table on a
    terminal and as plain appended lines when piped (so logs and CI keep every step)."""

    def __init__(self, domains: Sequence[str], console: Console) -> None:
        self.domains = list(domains)
        self.console = console
        self.rows: list[list[str]] = []
        self.live: Live | None = None
        self.widths = [max(len(h), 9) for h in watch_headers(self.domains)]

    def __enter__(self) -> WatchView:
        if self.console.is_terminal:
            self.live = Live(self.table(), console=self.console, auto_refresh=False)
            self.live.start()
        else:
            self._print_line(watch_headers(self.domains))
        return self

    def __exit__(self, *_: object) -> None:
        if self.live is not None:
            self.live.stop()

    def table(self) -> Table:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for header in watch_headers(self.domains):
            table.add_column(header, justify="right" if header != "PHASE" else "left")
        for row in self.rows[-40:]:  # the newest steps fit on one screen
            table.add_row(*row)
        return table

    def update(self, status: Mapping[str, Any]) -> bool:
        """Add a row if anything shown changed; returns whether it did."""
        row = watch_row(status, self.domains)
        if self.rows and self.rows[-1] == row:
            return False
        self.rows.append(row)
        if self.live is not None:
            self.live.update(self.table(), refresh=True)
        else:
            self._print_line(row)
        return True

    def _print_line(self, cells: Sequence[str]) -> None:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=False))
        self.console.print(line.rstrip(), markup=False, highlight=False, soft_wrap=True)


def run_events(
    cluster: Cluster, name: str, resource_version: str, deadline: float | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, object) of every change to one TrainingRun, reconnecting the watch as needed.

    A watch whose resourceVersion has been compacted away (410 Gone) restarts from a
    fresh read, which is yielded as a MODIFIED event so no state is missed.
    """
    import urllib3
    from kubernetes import watch
    from kubernetes.client.rest import ApiException

    while deadline is None or time.monotonic() < deadline:
        remaining = WATCH_CHUNK_S if deadline is None else deadline - time.monotonic()
        stream = watch.Watch()
        try:
            for event in stream.stream(
                cluster.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                cluster.namespace,
                TRAINING_RUN.plural,
                field_selector=f"metadata.name={name}",
                resource_version=resource_version,
                timeout_seconds=max(1, int(min(remaining, WATCH_CHUNK_S)) + 1),
            ):
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        break  # history compacted: re-read below
                    raise CommandFailed(
                        f"watch of trainingrun {name!r} failed: {obj.get('message')}"
                    )
                resource_version = obj["metadata"]["resourceVersion"]
                yield event["type"], obj
                if deadline is not None and time.monotonic() >= deadline:
                    return
            else:
                continue  # the server closed this watch chunk; reconnect from resource_version
        except ApiException as exc:
            if exc.status != 410:
                raise api_failure(exc, f"watch of trainingrun {name!r}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # The apiserver went away mid-watch (stopped, restarted): say so, no traceback.
            raise api_failure(exc, f"watch of trainingrun {name!r}") from None
        finally:
            stream.stop()
        fresh = cluster.get(TRAINING_RUN, name)
        resource_version = fresh["metadata"]["resourceVersion"]
        yield "MODIFIED", fresh


def watch_run(
    cluster: Cluster,
    name: str,
    timeout_s: float | None,
    console: Console,
) -> int:
    """Show the run's progress until it ends; 0 Succeeded, 1 Failed/deleted/timed out."""
    obj = cluster.get(TRAINING_RUN, name)
    domains = sorted(d["name"] for d in obj.get("spec", {}).get("domains", []))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tracer.start_as_current_span("ctl.watch") as span, WatchView(domains, console) as view:
        span.set_attribute("posttrain.name", name)
        span.set_attribute("posttrain.namespace", cluster.namespace)
        events = run_events(cluster, name, obj["metadata"]["resourceVersion"], deadline)
        current: dict[str, Any] = obj
        for event_type, current in _with_initial(obj, events):
            if event_type == "DELETED":
                return fail(f"trainingrun {name!r} was deleted while watching")
            status = current.get("status") or {}
            view.update(status)
            phase = status.get("phase")
            if phase in TERMINAL_PHASES:
                span.set_attribute("posttrain.phase", phase)
                break
        else:
            phase = (current.get("status") or {}).get("phase") or "Pending"
            return fail(
                f"timed out after {timeout_s:g}s; trainingrun {name!r} is still {phase} "
                f"at step {format_step(current.get('status') or {})}"
            )
    return finish_message(name, current.get("status") or {})


def _with_initial(
    obj: dict[str, Any], events: Iterator[tuple[str, dict[str, Any]]]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The state read before watching, then every change: a finished run ends at once."""
    yield "ADDED", obj
    yield from events


def finish_message(name: str, status: Mapping[str, Any]) -> int:
    """Print how the run ended and return its exit code."""
    phase = status.get("phase")
    if phase == "Succeeded":
        print(
            f"trainingrun {name} Succeeded at step {format_step(status)}; "
            f"eval accuracy {format_domains(status.get('evalAccuracy'))}; "
            f"checkpoint {status.get('lastCheckpoint') or '-'}"
        )
        return 0
    failed = next((c for c in status.get("conditions", []) if c.get("type") == "Failed"), None)
    why = f"{failed.get('reason')}: {failed.get('message')}" if failed else status.get("message")
    return fail(
        f"trainingrun {name} Failed at step {format_step(status)}"
        + (f" ({why})" if why else "")
        + f"; see `posttrain describe tr {name}` and `posttrain logs tr {name}`"
    )


@exits_1_on_failure
def watch_command(args: argparse.Namespace) -> int:
    require_run_kind(args.kind, "watch")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    return watch_run(cluster_from_args(args), args.name, args.timeout, make_console())


# ----------------------------------------------------------------------------- logs


def pick_trainer_pod(pods: Sequence[Any]) -> Any | None:
    """Rank 0 of the newest gang: the pod whose log tells the run's story.

    A restart deletes the failed gang's pods, but one still terminating may be listed beside
    the next gang's: the newest gang is the one to read.
    """
    if not pods:
        return None

    def order(pod: Any) -> tuple[int, int]:
        labels = pod.metadata.labels or {}
        return (-_int(labels.get(LABEL_GANG)), _int(labels.get(LABEL_RANK)))

    return sorted(pods, key=order)[0]


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


@exits_1_on_failure
def logs_command(args: argparse.Namespace) -> int:
    require_run_kind(args.kind, "logs")
    if args.tail is not None and args.tail < 0:
        raise UsageError(f"--tail must be >= 0, got {args.tail}")
    cluster = cluster_from_args(args)
    return stream_trainer_logs(cluster, args.name, args.follow, args.tail, args.container)


def stream_trainer_logs(
    cluster: Cluster, name: str, follow: bool, tail: int | None, container: str | None
) -> int:
    """Write the trainer pod's log to stdout (until it ends, with ``follow``)."""
    run = cluster.get(TRAINING_RUN, name)
    phase = (run.get("status") or {}).get("phase") or "Pending"
    try:
        pods = cluster.core.list_namespaced_pod(
            cluster.namespace, label_selector=trainer_selector(name)
        ).items
    except Exception as exc:
        raise api_failure(exc, f"pods of trainingrun {name!r}") from None
    pod = pick_trainer_pod(pods)
    if pod is None:
        kept = dev_agent_log(cluster, name)
        if kept is not None:  # the dev node agent keeps a deleted pod's log on disk
            print(
                f"# trainer pod {kept.stem.split('_', 1)[1]} is gone (the run is {phase}); "
                f"its log, kept by `posttrain dev agent` until `posttrain dev down`: {kept}",
                file=sys.stderr,
            )
            text = kept.read_text(errors="replace")
            sys.stdout.write(
                text
                if tail is None
                else "".join(text.splitlines(keepends=True)[-tail:] if tail else [])
            )
            return 0
        if phase in TERMINAL_PHASES:
            return fail(
                f"trainingrun {name} is {phase} and its trainer pods are gone (the operator "
                "keeps finished ones, so they were deleted or lost); its outputs are in storage: "
                f"posttrain describe tr {name} shows the last checkpoint"
            )
        return fail(f"no trainer pod yet: the run is {phase}; see posttrain describe tr {name}")
    names = [c.name for c in pod.spec.containers]
    chosen = container or (TRAINER_CONTAINER if TRAINER_CONTAINER in names else names[0])
    if chosen not in names:
        raise UsageError(f"-c {chosen}: pod {pod.metadata.name} has containers {names}")
    if not container_started(pod, chosen):
        # The apiserver answers 204 with no body here, which would look like an empty log.
        return fail(
            f"trainer pod {pod.metadata.name} has no logs yet: {pod_phase(pod)}; "
            f"see posttrain describe tr {name}"
        )
    print(f"# pod {pod.metadata.name} ({pod.status.phase}), container {chosen}", file=sys.stderr)
    try:
        # Unparsed, so a followed log streams chunk by chunk instead of buffering to the end.
        response = cluster.core.read_namespaced_pod_log(
            pod.metadata.name,
            cluster.namespace,
            container=chosen,
            follow=follow,
            tail_lines=tail,
            _preload_content=False,
        )
    except Exception as exc:
        raise api_failure(exc, f"logs of pod {pod.metadata.name}") from None
    if response.status >= 400:  # an unparsed response is not raised as an ApiException
        message = _status_message(response.data, response.reason)
        response.release_conn()
        if response.status == 400:  # container not started: Pending, unscheduled, pulling
            return fail(
                f"trainer pod {pod.metadata.name} has no logs yet ({pod.status.phase}: "
                f"{message}); see posttrain describe tr {name}"
            )
        if response.status >= 500:  # the apiserver could not reach the node's kubelet
            raise CommandFailed(
                f"logs of pod {pod.metadata.name}: the apiserver could not fetch them from "
                f"node {pod.spec.node_name} ({response.status}: {message}); is the node's "
                "kubelet (on the dev control plane: `posttrain dev agent`) running?"
            )
        raise CommandFailed(f"logs of pod {pod.metadata.name}: {response.status} {message}")
    try:
        for chunk in response.stream(4096):
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()
    finally:
        response.release_conn()
    return 0


def dev_agent_log(cluster: Cluster, run_name: str) -> Path | None:
    """The log file `posttrain dev agent` kept of the run's newest rank-0 trainer pod.

    Only on the cluster `posttrain dev up` started (its state names the kubeconfig);
    None anywhere else or when the agent kept no such file.
    """
    from posttrain.devenv.cli import DevState

    state = DevState.load()
    if state is None or Path(state.kubeconfig).resolve() != cluster.kubeconfig.resolve():
        return None
    logs = Path(state.workdir) / "nodeagent"
    prefix = f"{cluster.namespace}_{run_name}-g"
    newest: tuple[int, Path] | None = None
    for path in logs.glob(f"{prefix}*-0.log"):
        gang = path.name.removeprefix(prefix).removesuffix("-0.log")
        if gang.isdigit() and (newest is None or int(gang) > newest[0]):
            newest = (int(gang), path)
    return newest[1] if newest else None


def container_started(pod: Any, container: str) -> bool:
    """Whether ``container`` ever ran (running or terminated), i.e. there is a log to read."""
    for status in pod.status.container_statuses or []:
        if status.name == container and status.state is not None:
            return bool(status.state.running or status.state.terminated)
    return False


def _status_message(body: bytes, reason: str) -> str:
    """The message of a metav1.Status body.

    >>> _status_message(b'{"kind": "Status", "message": "pod has no host"}', "Bad Request")
    'pod has no host'
    """
    try:
        return str(json.loads(body).get("message") or reason)
    except ValueError:
        return reason
