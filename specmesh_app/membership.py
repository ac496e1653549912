"""Who is up in a specmesh Ray Serve application, and what Prometheus sees of it (specmesh_app/deploy.py).

Replicas announce themselves to the ``Membership`` deployment every heartbeat (``Announcer``): their gRPC address,
which the orchestrators follow, their metrics port, the model they serve and the stats they report to Serve's
autoscaler. ``Roster`` is the pure part: who was heard from within its ttl. ``Membership`` also turns the roster
into Prometheus' scrape targets (a file_sd file, ``/targets`` for http_sd) and exports the autoscaler's view of the
pools, read from the heartbeats and from Serve's controller (specmesh_app/fleet_metrics.py says why there).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ray import serve
from ray.serve.handle import DeploymentHandle

from specmesh import metrics, rpc
from specmesh_app import fleet_metrics
from specmesh_app.fleet_metrics import APPLICATION, DEPLOYMENT, REPLICA, Member

log = logging.getLogger("specmesh.deploy")

VERIFIER, DRAFTER, ORCHESTRATOR = "verifier", "drafter", "orchestrator"  # the kinds of replica that announce


def or_runtime_error(fn: Callable, *args):
    """``fn(*args)``, its one-line SystemExit (a bad option, a missing model) turned into an error Serve shows."""
    try:
        return fn(*args)
    except SystemExit as exc:
        raise RuntimeError(str(exc)) from None


class Roster:
    """Which replicas of each kind are up. A replica announces itself every few seconds; one silent for
    ``ttl`` seconds is gone (killed without a goodbye)."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._seen: dict[tuple[str, str], tuple[Member, float]] = {}  # (kind, replica) -> (its news, last seen)

    def announce(self, kind: str, replica: str, address: str, **about) -> None:
        """``about``: the rest of a ``Member`` (deployment, metrics port, model, autoscaling signals)."""
        self._seen[(kind, replica)] = (Member(address, **about), self.clock())

    def withdraw(self, kind: str, replica: str) -> None:
        self._seen.pop((kind, replica), None)

    def _forget_silent(self) -> None:
        cutoff = self.clock() - self.ttl
        for key in [k for k, (_, seen) in self._seen.items() if seen < cutoff]:
            del self._seen[key]

    def members(self, kind: str) -> list[str]:
        """Addresses of the replicas of ``kind`` heard from within ``ttl``, sorted."""
        self._forget_silent()
        return sorted(member.address for (k, _), (member, _) in self._seen.items() if k == kind)

    def live(self) -> dict[str, Member]:
        """Every replica heard from within ``ttl``: replica id -> what it announced last."""
        self._forget_silent()
        return {replica: member for (_, replica), (member, _) in self._seen.items()}

    def model_name(self) -> str:
        """The served model's name as the orchestrators announce it (else the verifiers), "" before any does."""
        names = {kind: member.model_name for (kind, _), (member, _) in sorted(self._seen.items()) if member.model_name}
        return names.get(ORCHESTRATOR) or names.get(VERIFIER) or next(iter(names.values()), "")


@serve.deployment(name="Membership", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # a call per replica per heartbeat
class Membership:
    """The Roster as a deployment. Replicas re-announce every heartbeat, so a restarted Membership is whole
    again one heartbeat later. Every ``heartbeat_s`` it also turns the roster into Prometheus' scrape targets
    (``targets_file``, and ``/targets`` on its metrics port) and reads Serve's targets for the autoscale
    gauges of its registry (specmesh_app/fleet_metrics.py)."""

    async def __init__(self, ttl: float, heartbeat_s: float = 2.0, upstream_token_file: str | None = None,
                       metrics_port: int = 0, targets_file: str | None = None) -> None:
        """``upstream_token_file``: the orchestrator's ``--upstream-token-file`` (else $SPECMESH_UPSTREAM_TOKEN, as
        it reads): that token, the one every replica accepts, guards the metrics port as it guards theirs."""
        self.roster, self.heartbeat_s = Roster(ttl), heartbeat_s
        self.labels = fleet_metrics.replica_labels(serve.get_replica_context())
        self.application = self.labels[APPLICATION]
        try:
            upstream = rpc.Security.load(token_file=upstream_token_file, token_env=rpc.UPSTREAM_TOKEN_ENV)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"Membership: the upstream token: {exc}") from None
        self.access = metrics.MetricsAccess(upstream.tokens[:1])
        self.targets_file = Path(targets_file) if targets_file else None
        self.metrics_port, self.metrics_address = metrics_port, None
        self.view = fleet_metrics.PoolView()
        self.targets_json, self._written = b"[]", None
        # the autoscale gauges describe the pools (their own `deployment` label): no replica label here
        self.registry = metrics.Registry({APPLICATION: self.application})
        fleet_metrics.AutoscaleMetrics(lambda: self.view, self.registry)
        self._watcher = asyncio.ensure_future(self._watch_forever())

    def announce(self, kind: str, replica: str, address: str, deployment: str = "", metrics: str | None = None,
                 model_name: str = "", signals: Mapping[str, float] | None = None) -> None:
        self.roster.announce(kind, replica, address, deployment=deployment, metrics=metrics, model_name=model_name,
                             signals=dict(signals or {}))

    def withdraw(self, kind: str, replica: str) -> None:
        self.roster.withdraw(kind, replica)

    def members(self, kind: str) -> list[str]:
        return self.roster.members(kind)

    def targets(self) -> list[dict]:
        """The scrape targets now (for operators and tests; Prometheus reads the file or /targets)."""
        return json.loads(self.targets_json)

    async def _watch_forever(self) -> None:
        while True:
            try:
                await self._refresh()
            except Exception as exc:  # the controller busy or restarting: the next round tries again
                log.warning("membership: could not refresh the scrape targets or Serve's targets: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def _refresh(self) -> None:
        if self.metrics_address is None:
            self._start_metrics()
        live = self.roster.live()
        if self.metrics_address is not None:
            live[self.labels[REPLICA]] = Member("", self.labels[DEPLOYMENT], self.metrics_address)
        document = fleet_metrics.targets(live, self.application)
        self.targets_json = json.dumps(document).encode()
        if self.targets_file is not None and document != self._written:
            await asyncio.to_thread(fleet_metrics.write_targets, self.targets_file, document)
            self._written = document
        signals = fleet_metrics.pool_signals(live.values())
        # the signals first: a controller slow to answer (or restarting) leaves them current, its counts as they were
        self.view = fleet_metrics.PoolView(self.roster.model_name(), signals, self.view.counts)
        details = await asyncio.to_thread(serve_details)
        self.view = fleet_metrics.PoolView(self.view.model_name, signals,
                                           fleet_metrics.replica_counts(details, self.application))

    def _start_metrics(self) -> None:
        """Membership's metrics port. A fixed one still held (by the replica this one replaces) is tried again
        next round rather than failing the constructor: Serve gives up on a deployment whose replicas keep
        failing to start, and the roster matters more than its gauges."""
        try:
            self.metrics_address = serve_replica_metrics(
                self.registry, self.access, self.metrics_port,
                {"/targets": lambda: (self.targets_json, "application/json")})
        except RuntimeError as exc:
            log.warning("membership: %s; trying again in %.0f s", exc, self.heartbeat_s)

    async def __del__(self) -> None:
        if hasattr(self, "_watcher"):
            self._watcher.cancel()
            if self.targets_file is not None:  # no stale targets for a Prometheus to keep failing on
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(fleet_metrics.write_targets, self.targets_file, [])


def serve_details() -> dict:
    """Serve's instance details (``ServeInstanceDetails`` as a dict: what `serve status` and Ray's dashboard
    show, each deployment's ``target_num_replicas`` and replicas), from the controller. Through the client
    ``serve.status()`` itself uses (``_get_global_client``, private in Ray 2.60: the public ``serve.status()``
    leaves the targets out); tests/test_ray_serve.py reads the targets it yields in Prometheus."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


def listen_host(node_ip: str) -> str:
    """Where a replica's gRPC server listens: loopback on a local cluster (Ray's node address is loopback there
    when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, else Ray 2.60 swaps in the interface's), every interface on a
    real one (the node's address is how other nodes reach it)."""
    try:
        loopback = ipaddress.ip_address(node_ip).is_loopback
    except ValueError:
        loopback = False
    return ("[::1]" if ":" in node_ip else "127.0.0.1") if loopback else ("[::]" if ":" in node_ip else "0.0.0.0")


def node_address(node: str, port: int) -> str:
    return f"[{node}]:{port}" if ":" in node else f"{node}:{port}"


def serve_replica_metrics(registry, access: metrics.MetricsAccess, port: int = 0,
                          routes: Mapping[str, Callable[[], tuple[bytes, str]]] | None = None) -> str:
    """Serve ``registry`` at /metrics on ``port`` of this replica's node (0: a free one), where its gRPC service
    would listen (``listen_host``), as ``access`` allows; the HOST:PORT others scrape. RuntimeError with one
    line when the port cannot be bound."""
    import ray

    node = ray.util.get_node_ip_address()
    bound = or_runtime_error(metrics.start_metrics_server, f"{listen_host(node)}:{port}", registry, access, routes)
    return node_address(node, bound)


class Announcer:
    """Announces this replica to Membership every ``heartbeat_s``: its gRPC ``address``, its metrics port, the
    model it serves and ``signals()`` (the stats it reports to Serve's autoscaler), until ``withdraw``."""

    def __init__(self, kind: str, address: str, membership: DeploymentHandle, heartbeat_s: float,
                 metrics_address: str | None = None, model_name: str = "",
                 signals: Callable[[], Mapping[str, float]] = dict) -> None:
        self.kind, self.address, self.membership, self.heartbeat_s = kind, address, membership, heartbeat_s
        labels = fleet_metrics.replica_labels(serve.get_replica_context())
        self.replica, self.deployment = labels[REPLICA], labels[DEPLOYMENT]
        self.metrics_address, self.model_name, self.signals = metrics_address, model_name, signals
        self._task = asyncio.ensure_future(self._announce_forever())

    async def _announce_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.membership.announce.remote(
                    self.kind, self.replica, self.address, deployment=self.deployment, metrics=self.metrics_address,
                    model_name=self.model_name, signals=dict(self.signals())), self.heartbeat_s)
            except Exception as exc:  # Membership restarting: the next heartbeat tries again
                log.warning("could not announce %s %s: %s", self.kind, self.address or self.replica, exc)
            await asyncio.sleep(self.heartbeat_s)

    async def withdraw(self) -> None:
        self._task.cancel()
        # bounded: when the whole application is deleted, Membership may be gone already (a handle call would
        # wait for it to come back)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.membership.withdraw.remote(self.kind, self.replica), 1.0)
