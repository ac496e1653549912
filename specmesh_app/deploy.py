"""specmesh on Ray Serve: verifier, drafter and orchestrator pools as separate deployments.

    serve run deploy/serve_config.yaml            # a laptop; the YAML says how many of each, and where
    import path: specmesh_app.deploy:build_app    # args: AppArgs below

Deployments (each scales on its own; deploy/README.md has the reasons):

- ``Verifier`` replicas run `specmesh verifier`'s gRPC service (same options, same code) on a free port of
  their node; ``Drafter`` replicas run `specmesh drafter`'s. Each announces its address to ``Membership``
  every ``heartbeat_s`` and withdraws it when Serve stops it; a replica that died without a word drops out
  after three missed heartbeats.
- ``Orchestrator`` is the ingress: the OpenAI-compatible HTTP API through Serve's HTTP proxy and the
  ``Generate`` gRPC service through Serve's gRPC proxy, both over the same ``GenerationService`` and
  ``RemoteBackend`` as `specmesh serve`; it follows ``Membership`` to know the replicas and reaches them over
  gRPC. Verifier sessions hold KV caches, so a request must stick to one replica for its whole life: the
  engine's own gRPC clients do that (and fail over between drafters), where Serve's handles would route every
  call anew.
- Replicas report their load to Serve's autoscaler (``record_autoscaling_stats``: sessions and KV pool use
  for verifiers, drafting time for drafters), which specmesh_app/autoscaling.py turns into replica counts.
- Every replica serves its Prometheus registry on a free port of its node, its samples labelled with the
  replica (specmesh_app/fleet_metrics.py), and announces the port with its heartbeat; ``Membership``
  (specmesh_app/membership.py) turns the announcements into scrape targets (a file_sd file, ``/targets`` for
  http_sd) and exports the autoscaler's signals and targets (``specmesh_autoscale_*``).
- Stopping a replica (scale-down, redeploy) drains it: it withdraws from ``Membership``, refuses new sessions
  (UNAVAILABLE: the orchestrator uses another replica) and waits up to ``drain_timeout_s`` for its open ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from specmesh import metrics, models, rpc, serving
from specmesh.host_runtime import freeze_heap, tune_host_allocator
from specmesh_app import fleet_metrics
from specmesh_app.autoscaling import DRAFT_BUSY, DRAFT_LATENCY_MS, KV_USAGE, SESSIONS
from specmesh_app.membership import (
    DRAFTER,
    ORCHESTRATOR,
    VERIFIER,
    Announcer,
    Membership,
    listen_host,
    node_address,
    or_runtime_error,
    serve_replica_metrics,
)

log = logging.getLogger("specmesh.deploy")

# options Serve decides for its replicas: where they listen, how they are told apart, where metrics go (a free
# port each, announced to Membership: specmesh_app/fleet_metrics.py)
REPLICA_OPTIONS = ("--listen", "--ready-file", "--reuse-port", "--metrics")
SERVE_OPTIONS = ("--listen", "--http", "--verifier", "--drafter", "--embedded", "--metrics", "--health",
                 "--ready-file", "--reuse-port")  # --health: Serve's proxy and its replica health checks probe it


class AppArgs(BaseModel):
    """The application's ``args`` in a Serve config. Options are those of the matching `specmesh` command."""

    model_config = ConfigDict(extra="forbid")

    verifier: list[str] = Field(default_factory=list,
                                description="`specmesh verifier` options of every verifier replica (--target, "
                                            "--dtype, --kv-cache-gb, ...); not --listen, the replica picks a port")
    drafter: list[str] | None = Field(default_factory=list,
                                      description="`specmesh drafter` options of every drafter replica; null = no "
                                                  "drafter pool (requests draft by prompt lookup in the "
                                                  "orchestrator)")
    serve: list[str] = Field(default_factory=list,
                             description="`specmesh serve` options of the orchestrator (--proposer, "
                                         "--max-concurrent, --model-name, --token-file, ...); not --verifier, "
                                         "--drafter, --http or --listen: Serve provides those")
    heartbeat_s: float = Field(2.0, gt=0, description="seconds between a replica's announcements")
    drain_timeout_s: float = Field(60.0, ge=0, description="seconds a stopping replica waits for its sessions")
    metrics_targets_file: str | None = Field(
        None, description="where Membership writes every replica's metrics port as Prometheus file_sd targets "
                          "(JSON, rewritten as replicas come and go; a relative path is the replica's working "
                          "directory's, where `serve run` started on a local cluster); null = no file")
    membership_metrics_port: int = Field(
        0, ge=0, le=65535, description="port of Membership's /metrics (the autoscaler's gauges) and /targets "
                                       "(the same targets for Prometheus' http_sd_configs); 0 = a free port, "
                                       "listed in the targets")


def parse_options(command: str, options: Sequence[str], decided_by_serve: Iterable[str] = ()) -> argparse.Namespace:
    """``options`` parsed as `specmesh <command>` would; ValueError with argparse's message if they do not
    parse, or if they set one of ``decided_by_serve``."""
    from specmesh_app.cli import build_parser

    for option in options:
        if option.split("=", 1)[0] in decided_by_serve:
            raise ValueError(f"{command} options: {option.split('=', 1)[0]} is decided by Ray Serve here; remove it")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser([command]).parse_args([command, *options])
    except SystemExit:
        raise ValueError(f"{command} options {list(options)}: {stderr.getvalue().strip()}") from None


# ------------------------------------------------------------------ replicas' gRPC services
class HostedService:
    """A specmesh gRPC service listening on a free port of this replica's node, announced to Membership with
    the replica's metrics port."""

    def __init__(self, kind: str, started: rpc.StartedServer, address: str, announcer: Announcer) -> None:
        self.kind, self.started, self.address, self.announcer = kind, started, address, announcer

    @classmethod
    async def start(cls, kind: str, servicer, add_to_server: Callable, service_name: str, security: rpc.Security,
                    membership: DeploymentHandle, heartbeat_s: float, metrics_address: str, model_name: str,
                    signals: Callable[[], Mapping[str, float]]) -> HostedService:
        import ray

        server = rpc.new_server(security)
        add_to_server(servicer, server)
        node = ray.util.get_node_ip_address()
        started = await rpc.start_server(server, f"{listen_host(node)}:0", security, [service_name])
        address = node_address(node, started.port)
        log.info("%s replica serving on %s, metrics at %s", kind, address, metrics_address)
        return cls(kind, started, address,
                   Announcer(kind, address, membership, heartbeat_s, metrics_address, model_name, signals))

    async def stop(self, drain: Callable[[float], object], timeout: float) -> None:
        """Withdraw, let ``drain(timeout)`` refuse new sessions and wait for open ones, then stop the server."""
        await self.announcer.withdraw()
        if not await drain(timeout):
            log.warning("%s %s stopping with sessions still open after %.0f s", self.kind, self.address, timeout)
        await self.started.drain(1.0)


# ------------------------------------------------------------------ replicas
async def host_servicer(kind: str, options: list[str], build_servicer: Callable, add_to_server: Callable,
                        service_name: str, membership: DeploymentHandle, heartbeat_s: float,
                        signals: Callable[[object], Callable[[], Mapping[str, float]]]):
    """`specmesh <kind>`'s servicer, built from its command-line ``options`` as the command builds it (the model
    loaded off the event loop), its metrics served as ``--metrics`` serves them (labelled with this replica,
    under the API port's security), served and announced: (servicer, HostedService). ``signals(servicer)``:
    what the heartbeat carries for the autoscale gauges."""
    args = parse_options(kind, options, REPLICA_OPTIONS)
    tune_host_allocator()  # as the specmesh command does (host_runtime.py)
    serving.setup_logging(args)
    serving.setup_tracing(args)
    security = or_runtime_error(serving.server_security, args)
    registry = metrics.Registry(fleet_metrics.replica_labels(serve.get_replica_context()))
    servicer = await asyncio.to_thread(or_runtime_error, build_servicer, args, registry)
    freeze_heap()  # built: the GC never walks it again (specmesh/host_runtime.py)
    metrics_address = serve_replica_metrics(registry, metrics.MetricsAccess.of(args, security.tokens))
    hosted = await HostedService.start(kind, servicer, add_to_server, service_name, security, membership, heartbeat_s,
                                       metrics_address, args.model_name or models.served_name(args.target),
                                       signals(servicer))
    return servicer, hosted


def verifier_signals(servicer) -> dict[str, float]:
    """A verifier replica's load as its autoscaling policy reads it: open sessions, share of KV blocks taken."""
    verifier = servicer.verifier
    allocator = verifier.verifier.allocator
    return {SESSIONS: float(verifier.num_sessions), KV_USAGE: allocator.num_used / max(1, allocator.num_blocks)}


class DraftLoad:
    """A drafter replica's load since the previous ``read``: mean proposal latency and share of time drafting.
    One per reader (Serve's autoscaler, Membership's heartbeat): each read starts the next window."""

    def __init__(self, servicer, clock: Callable[[], float] = time.monotonic) -> None:
        self.servicer, self.clock = servicer, clock
        self._last = (clock(), servicer.drafts, servicer.draft_seconds)  # (when, drafts, draft seconds)

    def read(self) -> dict[str, float]:
        now, drafts, seconds = self.clock(), self.servicer.drafts, self.servicer.draft_seconds
        then, drafts_then, seconds_then = self._last
        self._last = (now, drafts, seconds)
        busy = seconds - seconds_then
        stats = {DRAFT_BUSY: min(1.0, busy / max(now - then, 1e-3))}
        if drafts > drafts_then:
            stats[DRAFT_LATENCY_MS] = busy / (drafts - drafts_then) * 1e3
        return stats


@serve.deployment(name="Verifier", ray_actor_options={"num_cpus": 1}, health_check_period_s=5)
class VerifierReplica:
    """`specmesh verifier` in a Serve replica (``num_gpus`` in ray_actor_options gives it a GPU)."""

    async def __init__(self, options: list[str], membership: DeploymentHandle, heartbeat_s: float = 2.0,
                       drain_timeout_s: float = 60.0) -> None:
        from specmesh.v1 import verifier_pb2_grpc
        from specmesh.wire import VERIFIER_SERVICE
        from verifier_service.server import build_servicer

        self.drain_timeout_s = drain_timeout_s
        self.servicer, self.hosted = await host_servicer(
            VERIFIER, options, build_servicer, verifier_pb2_grpc.add_VerifierServicer_to_server, VERIFIER_SERVICE,
            membership, heartbeat_s, lambda servicer: lambda: verifier_signals(servicer))
        self._reaper = asyncio.ensure_future(self.servicer.background())  # leases, --session-ttl

    def address(self) -> str:
        return self.hosted.address

    def check_health(self) -> None:
        if not self.servicer.verifier.alive:
            raise RuntimeError("the verifier's step loop is not running")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return verifier_signals(self.servicer)

    async def __del__(self) -> None:
        if hasattr(self, "_reaper"):  # stopped after its constructor finished
            self._reaper.cancel()
            await self.hosted.stop(self.servicer.drain, self.drain_timeout_s)
        if hasattr(self, "servicer"):
            self.servicer.verifier.close()


@serve.deployment(name="Drafter", ray_actor_options={"num_cpus": 0.5}, health_check_period_s=5)
class DrafterReplica:
    """`specmesh drafter` in a Serve replica (CPU only: drafting is latency-bound and small)."""

    async def __init__(self, options: list[str], membership: DeploymentHandle, heartbeat_s: float = 2.0,
                       drain_timeout_s: float = 60.0) -> None:
        from drafter_service.server import build_servicer
        from specmesh.v1 import drafter_pb2_grpc
        from specmesh.wire import DRAFTER_SERVICE

        self.drain_timeout_s = drain_timeout_s
        self.servicer, self.hosted = await host_servicer(
            DRAFTER, options, build_servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, DRAFTER_SERVICE,
            membership, heartbeat_s, lambda servicer: DraftLoad(servicer).read)
        self._load = DraftLoad(self.servicer)  # Serve's window, apart from the heartbeat's

    def address(self) -> str:
        return self.hosted.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Since the last report: the mean proposal latency and the share of time spent drafting."""
        return self._load.read()

    async def __del__(self) -> None:
        if hasattr(self, "hosted"):  # stopped after its constructor finished
            await self.hosted.stop(self.servicer.drain, self.drain_timeout_s)


# ------------------------------------------------------------------ orchestrator
class ServeCallContext:
    """What GenerateServicer needs of a gRPC call context, over Serve's gRPC proxy context: ``abort`` sets the
    status the proxy sends and ends the call."""

    def __init__(self, context) -> None:
        self.context = context

    def time_remaining(self) -> float | None:
        return None  # Serve's proxy does not pass the client's deadline on; its request_timeout_s applies

    async def abort(self, code: grpc.StatusCode, details: str):
        self.context.set_code(code)
        self.context.set_details(details)
        raise RuntimeError(details)


@serve.deployment(name="Orchestrator", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=512)
@serve.ingress()
class Orchestrator:
    """The ingress: `specmesh serve` over the replicas Membership knows (HTTP API and Generate gRPC)."""

    async def __init__(self, options: list[str], membership: DeploymentHandle, *pools: DeploymentHandle,
                       refresh_s: float = 1.0, grace: float = 6.0, heartbeat_s: float = 2.0) -> None:
        """``pools``: the Verifier and Drafter deployments, bound here only so that Serve deploys them with this
        application; requests reach their replicas over gRPC. ``grace``: seconds a replica missing from
        Membership is still used (``_sync``). ``heartbeat_s``: between this replica's own announcements (its
        metrics port)."""
        from orchestrator.metrics import ServeMetrics
        from orchestrator.server import GenerateServicer, build_service, load_tokenizer
        from orchestrator.service import RemoteBackend

        args = parse_options("serve", options, SERVE_OPTIONS)
        serving.setup_logging(args)
        serving.setup_tracing(args)
        self.args, self.membership, self.refresh_s, self.grace = args, membership, refresh_s, grace
        self.security = or_runtime_error(serving.server_security, args)
        self.upstream = or_runtime_error(serving.upstream_security, args, self.security)
        self.verifiers: dict = {}  # address -> VerifierClient
        self.drafters: dict = {}  # address -> DrafterClient
        self._absent: dict[str, float] = {}  # address -> when Membership first stopped listing it
        first, info = await self._first_verifier(args.connect_timeout)
        self.backend = RemoteBackend([first], [], info.max_tree_nodes, args.draft_timeout_ms / 1000, info.model)
        self.tokenizer_dir, tokenizer = await asyncio.to_thread(load_tokenizer, args, info.model)
        model_name = args.model_name or models.served_name(info.model or self.tokenizer_dir)  # as `serve` names it
        registry = metrics.Registry(fleet_metrics.replica_labels(serve.get_replica_context()))
        self.service = build_service(args, self.backend, tokenizer, model_name, ServeMetrics(model_name, registry))
        self.grpc = GenerateServicer(self.service)
        # its own port too (Serve's proxy hands each scrape of /metrics to any replica), under the internal token:
        # the one credential a Prometheus needs for every replica (the client tokens are the API's)
        access = metrics.MetricsAccess.of(args, self.upstream.tokens[:1])
        self.announcer = Announcer(ORCHESTRATOR, "", membership, heartbeat_s, serve_replica_metrics(registry, access),
                                   model_name)
        await self._sync()
        self._syncer = asyncio.ensure_future(self._sync_forever())

    def __serve_build_asgi_app__(self):
        from orchestrator import http_api
        from specmesh.chat import ChatTemplate

        return http_api.build_app(self.service, ChatTemplate.load(self.tokenizer_dir), self.security.tokens,
                                  self.args.request_timeout)

    # the Generate service through Serve's gRPC proxy (grpc_servicer_functions in the Serve config), which has
    # no interceptors: the bearer token is checked here, as `serve`'s gRPC port checks it
    async def _call_context(self, grpc_context) -> ServeCallContext:
        context = ServeCallContext(grpc_context)
        expected = rpc.bearer_values(self.security.tokens)
        if expected and not rpc.bearer_accepted(grpc_context.invocation_metadata(), expected):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return context

    async def Generate(self, request, grpc_context):
        return await self.grpc.Generate(request, await self._call_context(grpc_context))

    async def GenerateStream(self, request, grpc_context):
        async for chunk in self.grpc.GenerateStream(request, await self._call_context(grpc_context)):
            yield chunk

    def check_health(self) -> None:
        if self._syncer.done():
            raise RuntimeError("the membership sync stopped")

    async def __del__(self) -> None:
        if hasattr(self, "_syncer"):  # Serve has drained this replica's requests by now
            self._syncer.cancel()
            await self.announcer.withdraw()

    # ------------------------------------------------------------- replicas
    async def _first_verifier(self, timeout: float):
        """(client, Info) of a verifier that answers, waiting up to ``timeout`` s for the pool to come up."""
        deadline = time.monotonic() + timeout
        while True:
            for address in await self.membership.members.remote(VERIFIER):
                fetched = await asyncio.to_thread(self._fetched_verifier, address, None)
                if fetched is not None:
                    self.verifiers[address] = fetched[0]
                    return fetched
            if time.monotonic() > deadline:
                raise RuntimeError(f"no verifier replica answered within {timeout:.0f} s (--connect-timeout)")
            await asyncio.sleep(self.refresh_s)

    def _fetched_verifier(self, address: str, vocab_size: int | None):
        """(client, its Info) of the verifier at ``address`` if it answered Info (with this vocabulary), else
        None for now."""
        from verifier_service.remote import VerifierClient

        client = VerifierClient(address, self.upstream)
        try:
            info = client.fetch_info(2.0)
        except rpc.UpstreamError as exc:
            log.warning("verifier %s not ready: %s", address, exc)
            return None
        if vocab_size is not None and info.vocab_size != vocab_size:
            log.error("verifier %s serves a vocabulary of %d, the others %d: not used", address, info.vocab_size,
                      vocab_size)
            return None
        return client, info

    async def _sync(self) -> None:
        """Follow Membership: new replicas in at once; gone ones out once absent for ``grace`` seconds, so
        that a restarted Membership (empty until the next heartbeats) takes no replica away. A replica kept
        meanwhile that is really gone refuses connections, which moves a request to another before its first
        token; a draining one refuses new sessions the same way."""
        from drafter_service.remote import DrafterClient

        verifiers = await asyncio.wait_for(self.membership.members.remote(VERIFIER), 5.0)
        drafters = await asyncio.wait_for(self.membership.members.remote(DRAFTER), 5.0)
        now = time.monotonic()
        vocab = self.backend.info.vocab_size
        for address in verifiers:
            if address not in self.verifiers:
                fetched = await asyncio.to_thread(self._fetched_verifier, address, vocab)
                if fetched is not None:
                    self.verifiers[address] = fetched[0]
        for address in drafters:
            self.drafters.setdefault(address, DrafterClient(address, self.upstream))
        listed = set(verifiers) | set(drafters)
        for address in listed:
            self._absent.pop(address, None)
        for pool in (self.verifiers, self.drafters):
            for address in [a for a in pool if a not in listed]:
                if now - self._absent.setdefault(address, now) > self.grace:
                    del pool[address]
                    self._absent.pop(address)
        self.backend.set_replicas(list(self.verifiers.values()), list(self.drafters.values()))

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._sync()
            except Exception as exc:  # Membership restarting: keep the last known replicas
                log.warning("membership sync failed: %s", exc)

    def replicas(self) -> dict[str, list[str]]:
        """The replicas this orchestrator uses now (for operators and tests)."""
        return {VERIFIER: sorted(self.verifiers), DRAFTER: sorted(self.drafters)}


# ------------------------------------------------------------------ the application
def build_app(args: dict) -> serve.Application:
    """The application builder of ``import_path: specmesh_app.deploy:build_app``: ``args`` as AppArgs."""
    return application(args)


def application(args: AppArgs | dict, options: dict[str, dict] | None = None) -> serve.Application:
    """The Serve application. Every option list is parsed here first, so a typo fails `serve run` / `serve
    deploy` at once instead of in replicas Serve restarts. ``options``: deployment options by deployment name
    (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``, ...) for Python callers; a Serve
    config's ``deployments:`` list does the same."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    options = dict(options or {})
    unknown = set(options) - {"Membership", "Verifier", "Drafter", "Orchestrator"}
    if unknown:
        raise ValueError(f"options for unknown deployments {sorted(unknown)}: Membership, Verifier, Drafter, "
                         "Orchestrator")
    parse_options("verifier", args.verifier, REPLICA_OPTIONS)
    parse_options("serve", args.serve, SERVE_OPTIONS)
    if args.drafter is not None:
        parse_options("drafter", args.drafter, REPLICA_OPTIONS)

    def deployment(d, name: str, **defaults):
        return d.options(**{**defaults, **options.get(name, {})})

    shutdown = {"graceful_shutdown_timeout_s": args.drain_timeout_s + 10}
    upstream_token_file = parse_options("serve", args.serve, SERVE_OPTIONS).upstream_token_file
    membership = deployment(Membership, "Membership").bind(
        3 * args.heartbeat_s, args.heartbeat_s, upstream_token_file and str(upstream_token_file),
        args.membership_metrics_port, args.metrics_targets_file)
    pools = [deployment(VerifierReplica, "Verifier", **shutdown).bind(args.verifier, membership, args.heartbeat_s,
                                                                       args.drain_timeout_s)]
    if args.drafter is not None:
        pools.append(deployment(DrafterReplica, "Drafter", **shutdown).bind(args.drafter, membership,
                                                                            args.heartbeat_s, args.drain_timeout_s))
    return deployment(Orchestrator, "Orchestrator").bind(args.serve, membership, *pools,
                                                         grace=3 * args.heartbeat_s, heartbeat_s=args.heartbeat_s)
