"""gRPC plumbing shared by the specmesh servers and the client SDK (no torch here).

- ``Security``: bearer token and TLS files, read once at the edge.
- channel/server options: message-size limits, keepalive, and the retry policy
  (UNAVAILABLE is retried by gRPC itself, from the service config).
- ``BearerTokenInterceptor``: every RPC except health checks needs one of the server's tokens;
  ``caller_identity`` names the authenticated caller (token or client certificate).
- ``DecodeErrorInterceptor``: a request that does not parse is INVALID_ARGUMENT with a plain message.
- ``start_server``: health + reflection, listen, start; ``run_server`` adds SIGTERM/SIGINT -> NOT_SERVING,
  drain, stop (a Ray Serve replica drains from its own shutdown hook instead).
- servers and channels get OpenTelemetry's gRPC interceptors when tracing is on (``specmesh.tracing``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh import tracing

log = logging.getLogger("specmesh.rpc")

TOKEN_ENV = "SPECMESH_TOKEN"
HEALTH_SERVICE = "grpc.health.v1.Health"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a 1M-token prompt is ~10 MB of varints

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    *_KEEPALIVE,
]


def channel_options(retry_methods: Sequence[tuple[str, str]] = ()) -> list[tuple[str, object]]:
    """Client options; ``retry_methods``: (service, method) pairs that are safe to retry on UNAVAILABLE."""
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *_KEEPALIVE,
        # a replica that went away is tried again at most every half second (gRPC's default backoff grows to
        # 120 s), so one restarted on its address is used again within a second of serving; a connection
        # attempt is cheap next to a request failing over
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]
    if retry_methods:
        config = {
            "methodConfig": [{
                "name": [{"service": s, "method": m} for s, m in retry_methods],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }]
        }
        options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
    return options


# ------------------------------------------------------------------ security
UPSTREAM_TOKEN_ENV = "SPECMESH_UPSTREAM_TOKEN"


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """The bearer tokens in a token file: one per line; blank lines and ``#`` comments are skipped."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    tokens = tuple(line for line in lines if line and not line.startswith("#"))
    if not tokens:
        raise ValueError(f"the token file {path} holds no token")
    return tokens


@dataclass(frozen=True)
class Security:
    """Credentials of one endpoint.

    A server accepts any of ``tokens`` (each a separate caller identity, see ``caller_identity``) and, with
    cert/key, listens with TLS; with ``ca`` too it requires client certificates that CA signed (mutual TLS).
    A client presents ``token`` (the first of ``tokens``), trusts ``ca`` (else the system roots) and, with
    cert/key, presents a client certificate."""

    tokens: tuple[str, ...] = ()
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    @classmethod
    def load(
        cls,
        token: str | None = None,
        token_file: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        ca: str | Path | None = None,
        token_env: str = TOKEN_ENV,
    ) -> Security:
        """Token from the argument, else ``token_file`` (one or more), else $``token_env``; TLS material from
        PEM files."""
        if token is not None:
            tokens: tuple[str, ...] = (token,)
        elif token_file is not None:
            tokens = read_tokens(token_file)
        else:
            tokens = (os.environ[token_env],) if os.environ.get(token_env) else ()
        if any(not t or any(c.isspace() for c in t) for t in tokens):
            raise ValueError("a bearer token must be non-empty and hold no whitespace")
        if (cert is None) != (key is None):
            raise ValueError("a TLS certificate needs its key, and a key its certificate")

        def read(path):
            return Path(path).read_bytes() if path is not None else None

        return cls(tokens, read(cert), read(key), read(ca))

    @property
    def token(self) -> str | None:
        """The token this endpoint presents when it calls out."""
        return self.tokens[0] if self.tokens else None

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None:
            if self.ca is not None:
                raise ValueError("a server needs --tls-cert and --tls-key to require client certificates")
            return None
        mutual = self.ca is not None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)


def insecure_or_secure_channel(address: str, security: Security, options, aio: bool = False):
    """A channel to ``address``; with tracing on (specmesh/tracing.py) its calls carry the trace context."""
    creds = security.channel_credentials()
    if aio:
        interceptors = tracing.aio_channel_interceptors() or None
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    if creds is None:
        return tracing.intercept_channel(grpc.insecure_channel(address, options=options))
    return tracing.intercept_channel(grpc.secure_channel(address, creds, options=options))


def _bearer(metadata) -> str:
    value = dict(metadata or ()).get("authorization", "")
    return value.decode() if isinstance(value, bytes) else value


def bearer_accepted(metadata, expected: Sequence[bytes]) -> bool:
    """Whether a call's metadata carries ``authorization`` equal to one of ``expected`` (``b"Bearer <token>"``
    each). Compared with every one (a list, not a short-circuit): the time taken says nothing about which
    matched."""
    given = _bearer(metadata).encode()
    return any([hmac.compare_digest(given, e) for e in expected])


def bearer_values(tokens: Sequence[str]) -> list[bytes]:
    """The ``authorization`` values ``tokens`` stand for."""
    return [f"Bearer {t}".encode() for t in tokens]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` for one of ``tokens`` with UNAUTHENTICATED.
    Health checks stay open so load balancers and Kubernetes probes need no secret."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._expected = bearer_values(tokens)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        if bearer_accepted(details.invocation_metadata, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _denying_handler(handler)


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, as far as the transport authenticated it: ``token:<first 16 hex digits of the token's
    SHA-256>`` for a bearer token (a server with tokens has checked it), ``cert:<subject common name>`` for a
    client certificate (mutual TLS; the CA vouches for the name), both joined by ``,``; ``""`` when the call
    carries neither. Never holds a newline."""
    parts = []
    token = _bearer(context.invocation_metadata())
    if token:
        parts.append("token:" + hashlib.sha256(token.encode()).hexdigest()[:16])
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name") or []
    if names:
        parts.append("cert:" + names[0].decode(errors="replace").replace("\n", " "))
    elif auth.get("x509_pem_cert"):  # a certificate without a common name: its fingerprint
        parts.append("cert:" + hashlib.sha256(auth["x509_pem_cert"][0]).hexdigest()[:16])
    return ",".join(parts)


def _denying_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # pragma: no cover - makes this an async generator

    # the denying handler must have the streaming shape of the method it replaces
    req = bool(handler and handler.request_streaming)
    resp = bool(handler and handler.response_streaming)
    if req and resp:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if req:
        return grpc.stream_unary_rpc_method_handler(deny)
    if resp:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class _Undecodable:
    """What a request that failed to parse becomes, so that the handler can answer INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse as its message type gets INVALID_ARGUMENT with a plain message, not gRPC's
    UNKNOWN naming a Python exception: requests are parsed leniently and the method aborts on a bad one."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # served method -> its lenient handler

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        # a method's handler is the same object every call: wrap it once, not on every Verify of a session
        # (only methods the server has: a client's made-up names are not kept)
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._lenient(await continuation(details), details.method)
            if wrapped is not None:
                self._wrapped[details.method] = wrapped
        return wrapped

    @staticmethod
    def _lenient(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviours = [handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream]
        if not any(inspect.iscoroutinefunction(b) or inspect.isasyncgenfunction(b) for b in behaviours if b):
            return handler  # a synchronous handler (none of ours): left as gRPC runs it
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, or anything a parser raises on garbage
                return _Undecodable(exc)

        async def reject(context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {method.rsplit('/', 1)[-1]} message")

        if handler.request_streaming:
            async def checked(requests, context):
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        await reject(context)
                    yield request

            if handler.stream_stream:
                behaviour = handler.stream_stream

                async def wrapped(requests, context):
                    async for item in behaviour(checked(requests, context), context):
                        yield item
            else:
                behaviour = handler.stream_unary

                async def wrapped(requests, context):
                    return await behaviour(checked(requests, context), context)

            field = "stream_stream" if handler.stream_stream else "stream_unary"
        else:
            behaviour = handler.unary_unary or handler.unary_stream
            if handler.unary_stream:
                async def wrapped(request, context):
                    if isinstance(request, _Undecodable):
                        await reject(context)
                    async for item in behaviour(request, context):
                        yield item
            else:
                async def wrapped(request, context):
                    if isinstance(request, _Undecodable):
                        await reject(context)
                    return await behaviour(request, context)

            field = "unary_stream" if handler.unary_stream else "unary_unary"
        return handler._replace(request_deserializer=lenient, **{field: wrapped})


# -------------------------------------------------------------------- server
def new_server(security: Security, reuse_port: bool = False) -> grpc.aio.Server:
    """``reuse_port``: share the listening port with other processes (SO_REUSEPORT, gRPC's own default);
    off, a port already in use is an error instead of two servers answering on it at random. With tracing on,
    calls that pass the token check continue their caller's trace (specmesh/tracing.py)."""
    interceptors = [*tracing.server_interceptors(), DecodeErrorInterceptor()]
    if security.tokens:
        interceptors.insert(0, BearerTokenInterceptor(security.tokens))
    options = [*SERVER_OPTIONS, ("grpc.so_reuseport", int(reuse_port))]
    return grpc.aio.server(interceptors=interceptors, options=options)


@dataclass
class StartedServer:
    """A server listening: its port and its health service (``drain`` turns it NOT_SERVING)."""

    server: grpc.aio.Server
    port: int
    health: object  # grpc_health's aio HealthServicer

    async def drain(self, grace_seconds: float) -> None:
        """Health NOT_SERVING, in-flight RPCs get ``grace_seconds`` to finish, then the server stops."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_seconds)


async def start_server(
    server: grpc.aio.Server, address: str, security: Security, service_names: Sequence[str],
) -> StartedServer:
    """Add health + reflection, listen on ``address`` (port 0: any free port) and start; or OSError."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio
    from grpc_reflection.v1alpha import reflection

    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    creds = security.server_credentials()
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind"
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not this machine's "
                      "(--reuse-port lets servers share a port)")
    await server.start()
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("listening on %s (port %d)%s%s", address, port, ", TLS" if creds else "",
             ", token required" if security.tokens else "")
    return StartedServer(server, port, health)


async def run_server(
    server: grpc.aio.Server,
    address: str,
    security: Security,
    service_names: Sequence[str],
    grace_seconds: float = 10.0,
    on_started: Callable[[int], None] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    also_drain: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT: then health turns NOT_SERVING, in-flight RPCs get
    ``grace_seconds`` to finish, and the server stops. ``on_started(port)`` runs once listening;
    ``also_drain(grace_seconds)`` drains another listener of the process (the HTTP port) at the same time."""
    started = await start_server(server, address, security, service_names)
    if on_started is not None:
        on_started(started.port)

    waiter = asyncio.ensure_future(server.wait_for_termination())
    if await until_signalled(waiter):
        log.info("shutting down: NOT_SERVING, draining for up to %.0f s", grace_seconds)
        await asyncio.gather(started.drain(grace_seconds),
                             *([also_drain(grace_seconds)] if also_drain is not None else []))
    if on_stop is not None:
        await on_stop()
    waiter.cancel()


async def until_signalled(task: asyncio.Future) -> bool:
    """Wait until ``task`` ends or SIGTERM/SIGINT arrives; True if a signal came (``task`` still runs then)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    return stopping.is_set()


# --------------------------------------------------------------- upstreams
_BACKGROUND: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop) of this process's shared loop
_BACKGROUND_LOCK = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """This process's shared asyncio loop for ``grpc.aio`` calls made on behalf of synchronous callers (every
    drafter session's stream): one daemon thread, ``specmesh-aio``, started on first use (again in a forked
    child, which does not inherit the thread)."""
    global _BACKGROUND
    with _BACKGROUND_LOCK:
        if _BACKGROUND is None or _BACKGROUND[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="specmesh-aio", daemon=True).start()
            _BACKGROUND = (os.getpid(), loop)
        return _BACKGROUND[1]


class UpstreamError(RuntimeError):
    """A call to another specmesh service failed; ``code`` is its gRPC status. Its text names the replica (for
    the log); a client is told ``client_message`` instead."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{service}: {code.name}: {details}")
        self.service = service
        self.code = code
        self.details = details


# ------------------------------------------------------------ client texts
# what an upstream says is passed on only where it is about the request itself; the rest (a replica unreachable,
# failing, refusing serve's credentials) is told as the kind of service and the status, with the request's id:
# the server's log line of the request holds the whole text under that id
REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION})
_WHAT_HAPPENED = {
    grpc.StatusCode.UNAVAILABLE: "is unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
    grpc.StatusCode.CANCELLED: "cancelled the call",
    grpc.StatusCode.UNAUTHENTICATED: "refused serve's credentials",
    grpc.StatusCode.PERMISSION_DENIED: "refused serve's credentials",
}
_INTERNAL = re.compile(
    r"(?:ipv[46]:|unix:|dns:/*)?(?:\[[0-9A-Fa-f:.]+\]|(?:\d{1,3}\.){3}\d{1,3}|localhost)(?::\d+)?"  # IPs, ports
    r"|\b[A-Za-z0-9][\w-]*(?:\.[\w-]+)+:\d{2,5}\b"  # host.name:port
    r"|(?<![\w/.])(?:~|\.{1,2})?/(?:[\w.@+-]+/)+[\w.@+-]*"  # a path with a directory in it
)


def redact(text: str) -> str:
    """``text`` with network addresses and file-system paths replaced by ``<internal>``: what may reach a client
    of the words of an internal service or exception."""
    return _INTERNAL.sub("<internal>", text)


def with_request_id(text: str, request_id: str | None) -> str:
    return f"{text} (request {request_id}; the server's log has the details)" if request_id else text


def client_message(exc: UpstreamError, request_id: str | None = None) -> str:
    """What a client is told of a failed call to another service of the mesh: the kind of service (verifier,
    drafter) and what went wrong, never its address; the upstream's own words only for REQUEST_CODES (they are
    about the request), redacted."""
    kind = exc.service.split(" ", 1)[0]
    if exc.code in REQUEST_CODES or kind == "serve":  # "serve": this process's own words, about the request
        return redact(f"{kind}: {exc.details}")
    return with_request_id(f"a {kind} {_WHAT_HAPPENED.get(exc.code, 'failed')} ({exc.code.name})", request_id)


class ReplicaChannel:
    """A channel to one replica of a service, its stub, the call metadata, and how many sessions
    this process has open on it (what least-loaded placement sorts by)."""

    def __init__(self, address: str, security: Security, stub_class, retry_methods: Sequence[tuple[str, str]]) -> None:
        self.address = address
        self._security, self._options = security, channel_options(retry_methods)
        self._channel = insecure_or_secure_channel(address, security, self._options)
        self._stub = stub_class(self._channel)
        self._metadata = security.metadata()
        self._lock = threading.Lock()
        self.num_sessions = 0

    def _add_sessions(self, n: int) -> None:
        with self._lock:
            self.num_sessions += n

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether the replica answers the standard gRPC health check as SERVING within ``timeout`` s."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def aio_channel(self) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to the same replica with the same credentials and options, for calls made on
        the running event loop (create it there)."""
        return insecure_or_secure_channel(self.address, self._security, self._options, aio=True)

    def close(self) -> None:
        self._channel.close()


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` a status's number stands for (a message carrying one, a VerifyBatch item's);
    UNKNOWN for a number grpc does not define."""
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def call_timeout(deadline: float | None, default: float) -> float:
    """Seconds left for a call: ``default`` capped by an absolute time.monotonic() ``deadline``."""
    if deadline is None:
        return default
    import time

    return max(0.001, min(default, deadline - time.monotonic()))
