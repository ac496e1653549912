"""Prometheus metrics: what the three servers share (the option, the HTTP endpoint, histogram pieces).

Each server keeps its metrics in a ``CollectorRegistry`` of its own (never prometheus_client's global
one: tests build many servers in one process) and serves it with ``start_metrics_server`` when
``--metrics HOST:PORT`` is given, under the security of the server's API port (``MetricsAccess``: TLS and
client certificates with its certificates, its bearer tokens). Names start with ``specmesh_`` and follow vLLM's where vLLM has
the same quantity (``vllm:spec_decode_num_drafts`` -> ``specmesh_spec_decode_num_drafts``); counters
are exposed with prometheus_client's ``_total`` suffix, as vLLM's are. No colon: Prometheus reserves
colons for recording rules, and prometheus_client's OpenMetrics exposition (what a Prometheus server
negotiates) escapes one to ``_`` while its text format keeps it, so one counter would have two names.
``Registry`` leaves out prometheus_client's ``_created`` samples (vLLM turns them off process-wide): in
the text format they are gauges of their own (``X_created``) that the OpenMetrics format does not have,
so each endpoint and format exposes the same series, with HELP/TYPE for exactly those.

``Buckets`` is a histogram that a hot loop fills without prometheus_client (one bisect and two
additions, no lock) and a collector reads at scrape time: the verifier's scheduler records its
steps in it, and one collector sums the histograms of every verifier of a process.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from specmesh.serving import split_host_port

PREFIX = "specmesh_"
log = logging.getLogger("specmesh.metrics")

# histogram bounds shared by the servers
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # batch sizes, rows, nodes


def metrics_address(value: str) -> str:
    """argparse type of ``--metrics``: HOST:PORT (``[::1]:PORT`` for IPv6), port 0-65535 (0 = any free)."""
    try:
        split_host_port(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics", type=metrics_address, default=None, metavar="HOST:PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port, logged), "
                             "under the API's security: HTTPS with --tls-cert/--tls-key, client certificates with "
                             "--tls-ca, the bearer token with --token-file; default: off")


@dataclass(frozen=True)
class MetricsAccess:
    """Who may read the metrics port: the server's own posture. ``cert``/``key`` set = HTTPS with them;
    ``ca`` too = client certificates it signed required (mutual TLS); ``tokens`` = ``Authorization: Bearer`` with
    one of them required (what a Prometheus scrape config's ``authorization`` / ``tls_config`` send)."""

    tokens: tuple[str, ...] = ()
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def of(cls, args: argparse.Namespace, tokens: Sequence[str]) -> MetricsAccess:
        """The posture of a server's API port: its --tls-cert/--tls-key/--tls-ca and its bearer ``tokens``."""
        return cls(tuple(tokens), getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                   getattr(args, "tls_ca", None))

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.cert is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


METRICS_SOCKET_TIMEOUT = 30.0  # seconds a metrics connection may take for its handshake and request


class _QuietHandler(WSGIRequestHandler):
    """A scrape is not worth a log line; a client stalling its handshake or request is dropped after the timeout
    (each connection has a thread of its own, so it holds nobody else up meanwhile)."""

    timeout = METRICS_SOCKET_TIMEOUT

    def log_message(self, *args) -> None:
        pass


def bearer_guard(app, tokens: Sequence[str]):
    """A WSGI app answering 401 unless the request carries ``Authorization: Bearer`` with one of ``tokens``."""
    from specmesh import rpc

    expected = rpc.bearer_values(tokens)

    def guarded(environ, start_response):
        if rpc.bearer_accepted((("authorization", environ.get("HTTP_AUTHORIZATION", "")),), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong bearer token\n"]

    return guarded


def with_routes(app, routes: Mapping[str, Callable[[], tuple[bytes, str]]]):
    """A WSGI app answering GET on each path of ``routes`` with what its function returns (body, content type),
    and everything else as ``app``."""

    def routed(environ, start_response):
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return app(environ, start_response)
        body, content_type = route()
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return routed


def start_metrics_server(address: str, registry: CollectorRegistry, access: MetricsAccess = MetricsAccess(),
                         routes: Mapping[str, Callable[[], tuple[bytes, str]]] | None = None) -> int:
    """Serve ``registry`` at http(s)://``address``/metrics on a daemon thread, as ``access`` allows (TLS, client
    certificates, bearer tokens: the API port's); returns the bound port (``address`` may ask for port 0).
    ``routes``: other paths, under the same access (Ray Serve's Membership serves its scrape targets so).
    SystemExit with one line when the address cannot be bound (e.g. the port is taken) or a TLS file not read."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    host, port = split_host_port(address)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def handle_error(self, request, client_address) -> None:  # a failed handshake, a client gone: no traceback
            log.debug("metrics: a connection from %s failed", client_address[0], exc_info=True)

    app = make_wsgi_app(registry)
    if routes:
        app = with_routes(app, routes)
    if access.tokens:
        app = bearer_guard(app, access.tokens)
    try:
        context = access.ssl_context()
        server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"specmesh: cannot serve metrics at {address}: {getattr(exc, 'strerror', None) or exc}"
                         ) from None
    if context is not None:  # the handshake on the connection's own thread (its first read), not in accept()
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = server.server_port
    shown = f"[{host}]" if ":" in host else host
    log.info("Prometheus metrics at %s://%s:%d/metrics%s%s", "https" if context else "http", shown, bound,
             " (client certificates required)" if access.ca is not None and context else "",
             ", bearer token required" if access.tokens else "")
    return bound


class Buckets:
    """A histogram filled by one thread and read at scrape time: counts per upper bound (the last for
    values above every bound), their sum. Reads take no lock: a scrape may see a step half-recorded,
    never a count going down."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def histogram_family(name: str, documentation: str, histograms: Iterable[Buckets], labels: Sequence[str] = (),
                     label_values: Sequence[str] = ()) -> HistogramMetricFamily:
    """One Prometheus histogram summing ``histograms`` (all with the same bounds), for a custom collector; its
    one series has ``label_values`` for ``labels``."""
    histograms = list(histograms)
    bounds = histograms[0].bounds if histograms else ()
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for h in histograms:
        if h.bounds != bounds:
            raise ValueError(f"{name}: histograms with different bounds cannot be summed")
        for i, c in enumerate(list(h.counts)):  # list(): one copy, taken atomically
            counts[i] += c
        total += h.sum
    cumulative, running = [], 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        cumulative.append((floatToGoString(bound), running))
    family = HistogramMetricFamily(name, documentation, labels=labels)
    family.add_metric(label_values, cumulative, total)
    return family


class Registry(CollectorRegistry):
    """A CollectorRegistry without the ``_created`` samples prometheus_client adds to counters, histograms
    and summaries (the text format shows each as a gauge family of its own, OpenMetrics as a sample of its
    family: the two formats would disagree on the series and their metadata).

    ``labels``: labels every sample gets at scrape time, the same for the whole process (on Ray Serve a
    replica's ``replica``, ``deployment`` and ``application``: specmesh_app/fleet_metrics.py). Added here,
    not declared by each metric, so that names, label lists and the single-process servers stay as they are.
    A collector's own label of one of these names is a bug: the scrape fails with a ValueError naming it."""

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        super().__init__()
        self.labels = dict(labels or {})

    def collect(self):
        for family in super().collect():
            created = family.name + "_created"
            if family.type in ("counter", "histogram", "summary") and any(s.name == created for s in family.samples):
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = [s for s in family.samples if s.name != created]
                family = kept
            if self.labels:
                family = self._labelled(family)
            yield family

    def _labelled(self, family: Metric) -> Metric:
        labelled = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            clash = self.labels.keys() & sample.labels.keys()
            if clash:
                raise ValueError(f"{family.name}: label {sorted(clash)[0]!r} is the registry's own")
            labelled.samples.append(sample._replace(labels={**sample.labels, **self.labels}))
        return labelled


def new_registry(registry: CollectorRegistry | None = None, labels: dict[str, str] | None = None) -> CollectorRegistry:
    """``registry``, or a fresh ``Registry`` with ``labels`` on every sample (never the process-wide default)."""
    return registry if registry is not None else Registry(labels)


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """``registry`` rendered in the format an ``Accept`` header asks for (OpenMetrics for a Prometheus server,
    else text 0.0.4), as ``start_metrics_server`` answers: (body, content type)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
