"""Prometheus on Ray Serve: every replica scrapeable under its own name, and the autoscaler's view exported.

Each Verifier, Drafter and Orchestrator replica serves its registry (the very metrics of `specmesh verifier`,
`drafter` and `serve`) on a free port of its node, as ``--metrics`` does outside Ray: several replicas share a
node (a laptop, a CPU pod with three drafters and an orchestrator), so no port can be fixed per replica, and
Serve's HTTP proxy would hand successive scrapes of the orchestrator's ``/metrics`` to different replicas. A
``Registry`` with ``replica_labels`` puts ``replica``, ``deployment`` and ``application`` (Ray Serve's own label
names and values, as on its ``ray_serve_*`` series) on every sample, so the names stay those of
docs/observability.md and two replicas' series never merge.

Replicas announce that port to Membership with their heartbeat, which already knows every live replica; from
it Membership derives the scrape targets (``targets``: Prometheus' file_sd / http_sd format) and writes them
to a file (``metrics_targets_file``: a Prometheus on the same machine reads it) and serves them at
``/targets`` on its own metrics port (Prometheus' ``http_sd_configs``: a Prometheus elsewhere, e.g. on
Kubernetes).

The autoscaler's signals are exported by Membership, not where the policy runs: Serve calls the policy
(specmesh_app/autoscaling.py) inside its controller, a process nothing scrapes, with stats only it sees. So
replicas send Membership, with each heartbeat, the same stats they report to Serve
(``record_autoscaling_stats``), and Membership sums them per pool as the policy does (``pool_signals``; the
policy sees them averaged over its look-back window, Membership the last heartbeat's). The decision is read
from the controller itself: ``target_num_replicas`` of each deployment in Serve's instance details (what
``serve status`` and the dashboard show), with the replicas running. Membership is one replica per
application, so each gauge has one source (several orchestrators would export it several times).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from specmesh.atomic_io import atomic_write
from specmesh.metrics import PREFIX, new_registry
from specmesh_app.autoscaling import AVERAGED_SIGNALS

REPLICA, DEPLOYMENT, APPLICATION = "replica", "deployment", "application"


def replica_labels(context) -> dict[str, str]:
    """The labels of every sample a replica exports, from Serve's replica context: Serve's replica id (unique
    in the cluster), deployment and application names."""
    replica_id = context.replica_id
    return {REPLICA: replica_id.unique_id, DEPLOYMENT: replica_id.deployment_id.name,
            APPLICATION: replica_id.deployment_id.app_name}


@dataclass(frozen=True)
class Member:
    """What a replica announces with each heartbeat. ``address``: its gRPC service ("" for an orchestrator,
    which Serve's proxies reach); ``metrics``: HOST:PORT of its /metrics; ``signals``: the stats it reports to
    Serve's autoscaler."""

    address: str
    deployment: str = ""
    metrics: str | None = None
    model_name: str = ""
    signals: Mapping[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------ scrape targets
def targets(members: Mapping[str, Member], application: str) -> list[dict]:
    """Prometheus' file_sd / http_sd document: one group per replica with a metrics port (replica id -> Member),
    its labels those its samples carry (a scrape config with ``honor_labels: true`` keeps one copy), so that
    ``up`` names the replica too. Sorted: the file changes only when the replicas do."""
    return [{"targets": [member.metrics],
             "labels": {DEPLOYMENT: member.deployment, REPLICA: replica, APPLICATION: application}}
            for replica, member in sorted(members.items()) if member.metrics]


def write_targets(path: Path, document: list[dict]) -> None:
    """``document`` to ``path`` atomically (Prometheus re-reads a file_sd file when it changes: it must never
    see half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


# ------------------------------------------------------------------ the autoscaler's view
def pool_signals(members: Iterable[Member]) -> dict[str, dict[str, float]]:
    """deployment -> signal -> value over its replicas, as the policies aggregate them: summed, except
    ``AVERAGED_SIGNALS`` (a mean over the replicas that report it)."""
    totals: dict[str, dict[str, list[float]]] = {}
    for member in members:
        for signal, value in member.signals.items():
            if math.isfinite(value):
                totals.setdefault(member.deployment, {}).setdefault(signal, []).append(value)
    return {deployment: {signal: sum(values) / len(values) if signal in AVERAGED_SIGNALS else sum(values)
                         for signal, values in signals.items()}
            for deployment, signals in totals.items()}


def replica_counts(details: Mapping, application: str) -> dict[str, tuple[int, int]]:
    """deployment -> (target replicas, replicas running) of ``application`` in Serve's instance details (the
    controller's ``ServeInstanceDetails`` as a dict); {} when the application is not there."""
    app = (details.get("applications") or {}).get(application) or {}
    return {name: (int(deployment.get("target_num_replicas", 0)),
                   sum(1 for replica in deployment.get("replicas", ()) if replica.get("state") == "RUNNING"))
            for name, deployment in (app.get("deployments") or {}).items()}


@dataclass(frozen=True)
class PoolView:
    """One reading of the pools: signals from the replicas' heartbeats, counts from Serve's controller."""

    model_name: str = ""
    signals: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    counts: Mapping[str, tuple[int, int]] = field(default_factory=dict)


GAUGES = (
    ("autoscale_signal", "What a pool's replicas report to Serve's autoscaler, summed over them as the policy "
                         "sums it (draft_latency_ms: their mean).", [DEPLOYMENT, "signal"]),
    ("autoscale_target_replicas", "Replicas Serve's autoscaler wants for the deployment (its target).",
     [DEPLOYMENT]),
    ("autoscale_running_replicas", "Replicas of the deployment running.", [DEPLOYMENT]),
)


class AutoscaleMetrics:
    """``specmesh_autoscale_*`` gauges of ``view()`` (a cheap, thread-safe read: it runs on the metrics
    thread), in ``registry`` (default: a new one), labelled ``model_name`` and the deployment they describe."""

    def __init__(self, view: Callable[[], PoolView], registry: CollectorRegistry | None = None) -> None:
        self.view = view
        self.registry = new_registry(registry)
        self.registry.register(self)

    def describe(self):
        yield from (GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
                    for name, doc, labels in GAUGES)

    def collect(self):
        view = self.view()
        signal, target, running = (GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
                                   for name, doc, labels in GAUGES)
        for deployment, values in sorted(view.signals.items()):
            for name, value in sorted(values.items()):
                signal.add_metric([view.model_name, deployment, name], value)
        for deployment, (wanted, up) in sorted(view.counts.items()):
            target.add_metric([view.model_name, deployment], wanted)
            running.add_metric([view.model_name, deployment], up)
        yield from (signal, target, running)
