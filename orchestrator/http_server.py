"""The HTTP transport under the OpenAI API (orchestrator/http_api.py): uvicorn with the limits a public port
needs, TLS, and a drain that finishes in-flight requests.

- **Slow clients.** A request's headers and body must arrive within ``read_timeout`` seconds of its first byte
  (of the connection, for a first request), else the connection is closed; idle keep-alive connections close
  after ``keep_alive`` seconds (uvicorn's own timer). uvicorn has no such read timeout, so the connection
  class adds it (``guarded_protocol``), for either of uvicorn's HTTP/1.1 parsers.
- **Connections.** At most ``max_connections`` open at once, so idle sockets cannot exhaust the process's file
  descriptors (and with them /health and the gRPC port). A connection past the cap takes the place of the
  longest-idle one that is not being answered (kept alive between requests, or still sending its request),
  so a flood of idle or slow clients cannot lock out a new one; when every connection is being answered, the
  new one is closed. Either is logged at most once per ``LOG_INTERVAL`` seconds, with a count.
- **TLS** with the gRPC side's certificate (``TlsFiles``): client certificates required when a CA is given.
- **Drain** (``HttpServer.drain``): readiness 503 and new generation requests 503 while the requests in flight
  finish, for up to the grace; then those left are cut (``on_cut``: the app ends each with an answer its client
  can read) and the listener closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specmesh.probes import LOADING, JsonHandler, error_body
from specmesh.serving import json_logging, split_host_port

log = logging.getLogger("specmesh.http")

LOG_INTERVAL = 10.0  # seconds between two log lines about refused or timed-out connections
FD_RESERVE = 256  # file descriptors kept for everything but HTTP connections (gRPC, models, logs)
CUT_SECONDS = 2.0  # past the grace, how long the requests cut get to send their last bytes
ACCEPT_BATCH = 128  # asyncio accepts up to this many connections at once before any is seen: below FD_RESERVE, so
# a burst cannot overshoot the connection cap into EMFILE. The kernel's accept queue behind it is longer
# (``listen_backlog``): connections waiting there hold no file descriptor of ours.


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP port tolerates from its clients."""

    read_timeout: float = 60.0  # seconds for a request's headers and body to arrive
    keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 2048  # open connections; more are closed as they are accepted


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the HTTPS listener: ``ca`` set = client certificates it signed are required."""

    cert: Path
    key: Path
    ca: Path | None = None


class Throttled:
    """A warning logged at most once per ``interval`` seconds, saying how many were held back."""

    def __init__(self, message: str, interval: float = LOG_INTERVAL) -> None:
        self.message, self.interval = message, interval
        self.count, self.last = 0, None

    def __call__(self, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if self.last is None or now - self.last >= self.interval:
            log.warning(self.message + " [%d such since the last line like it]", *args, self.count)
            self.count, self.last = 0, now


def guarded_protocol(limits: HttpLimits) -> type:
    """uvicorn's HTTP/1.1 connection class with the read timeout and the connection cap of ``limits``."""
    over_cap = Throttled("HTTP connection refused: %d connections are open and all being answered "
                         "(--http-max-connections)")
    evicted = Throttled("HTTP connection closed to make room: %d connections are open (--http-max-connections)")
    too_slow = Throttled("HTTP connection closed: its request did not arrive within %.0f s (--http-read-timeout)")

    class GuardedConnection(AutoHTTPProtocol):
        _read_timer: asyncio.TimerHandle | None = None
        _idle_since = 0.0  # when it last finished a response or was opened

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._idle_since = time.monotonic()
            if len(self.connections) > limits.max_connections and not self._evict_one():
                over_cap(limits.max_connections)
                transport.abort()  # no response: the client retries elsewhere or later
                return
            self._arm()

        def _evict_one(self) -> bool:
            """Close the longest-idle other connection not being answered; False if there is none."""
            idle = [c for c in self.connections if c is not self and getattr(c, "_waiting_for_client", None)
                    and c._waiting_for_client() and not c.transport.is_closing()]
            if not idle:
                return False
            evicted(limits.max_connections)
            min(idle, key=lambda c: c._idle_since).transport.abort()
            return True

        def on_response_complete(self) -> None:
            self._idle_since = time.monotonic()
            super().on_response_complete()

        def data_received(self, data: bytes) -> None:
            if self._read_timer is None and self._between_requests():
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self._read_timer is not None and self._request_arrived():
                self._read_timer.cancel()
                self._read_timer = None

        def connection_lost(self, exc) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _waiting_for_client(self) -> bool:
            """Between requests, or still receiving one: nothing of ours is lost by closing it."""
            return self._between_requests() or self.cycle.more_body

        def _request_arrived(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete and not self.cycle.more_body

        def _arm(self) -> None:
            self._read_timer = self.loop.call_later(limits.read_timeout, self._read_timed_out)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self._request_arrived() and not self.transport.is_closing():
                too_slow(limits.read_timeout)
                self.transport.close()  # a request reading its body sees a disconnect

    return GuardedConnection


class _ThrottleAcceptErrors(logging.Filter):
    """asyncio logs every failed accept (EMFILE: out of file descriptors) with a traceback: at most one a
    ``LOG_INTERVAL``, without it."""

    def __init__(self) -> None:
        super().__init__()
        self.last, self.count = None, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        self.count += 1
        now = time.monotonic()
        if self.last is not None and now - self.last < LOG_INTERVAL:
            return False
        record.msg = f"HTTP: cannot accept connections: out of file descriptors [{self.count} since the last line]"
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.count = now, 0
        return True


def throttle_accept_errors() -> None:
    """Install the filter on asyncio's logger once."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _ThrottleAcceptErrors) for f in logger.filters):
        logger.addFilter(_ThrottleAcceptErrors())


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (up to the hard limit, as vLLM does); the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(limits: HttpLimits) -> HttpLimits:
    """``limits`` with max_connections lowered to what the file-descriptor limit allows (with a warning)."""
    fds = raise_fd_limit(limits.max_connections + FD_RESERVE)
    if fds == resource.RLIM_INFINITY or limits.max_connections + FD_RESERVE <= fds:
        return limits
    cap = max(1, fds - FD_RESERVE)
    log.warning("HTTP: at most %d connections (the open-file limit is %d; --http-max-connections %d asked)",
                cap, fds, limits.max_connections)
    return HttpLimits(limits.read_timeout, limits.keep_alive, cap)


def bind(address: str) -> socket.socket:
    """A listening socket on HOST:PORT (port 0 = any free port); OSError when the port is taken."""
    host, port = split_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


class LoadingResponder:
    """The HTTP port's answer while the process loads its models and warms up, before the app serves it (a
    context manager over the bound socket, plaintext ports only): ``/livez`` 200 (the process is alive: a
    liveness probe must not restart a replica that is loading), every other path 503 with OpenAI's error shape
    (``/health`` and ``/readyz`` included: it is not ready). One thread, ``http.server``'s: a few probes, no load.
    On exit it stops accepting; the socket stays open for the app's server, which takes the connections queued
    meanwhile."""

    def __init__(self, sock: socket.socket) -> None:
        import http.server
        import socketserver

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] == "/livez":
                    self.answer(200, {"status": "alive"})
                else:
                    self.answer(503, error_body(LOADING, "service_unavailable"))

            do_POST = do_GET  # noqa: N815

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self._server = Server(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self._server.socket.close()  # (the unbound one it made)
        self._server.socket = sock
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="http-loading", daemon=True)

    def __enter__(self) -> LoadingResponder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()  # (the socket is left open: the app's server listens on it next)
        self._thread.join(timeout=5)


def listen_backlog(limits: HttpLimits) -> int:
    """The API port's accept queue: as many connections as it may hold open (the fd budget,
    ``connection_cap``), at least ``ACCEPT_BATCH``; the kernel caps it at net.core.somaxconn (4096 by default
    since Linux 5.4)."""
    return max(ACCEPT_BATCH, limits.max_connections)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers (`specmesh serve` handles SIGTERM: drains both ports), listening with
    ``backlog`` (asyncio's listen() uses its accept batch, uvicorn's ``backlog``, for the kernel's queue too)."""

    def __init__(self, config: uvicorn.Config, backlog: int) -> None:
        super().__init__(config)
        self.listen_backlog = backlog

    def capture_signals(self):
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():
            sock.listen(self.listen_backlog)  # on a listening socket: only the queue's length changes


class HttpServer:
    """An ASGI app served on a bound socket until ``drain`` (or cancellation).

    ``draining``: set by ``drain`` (the app answers readiness and new work with 503 while it is);
    ``in_flight()``: the requests the drain waits for."""

    def __init__(self, app, sock: socket.socket, limits: HttpLimits = HttpLimits(), tls: TlsFiles | None = None,
                 in_flight: Callable[[], int] = lambda: 0, on_drain: Callable[[], None] = lambda: None,
                 access_log: bool = False, on_cut: Callable[[], int] = lambda: 0) -> None:
        limits = connection_cap(limits)
        throttle_accept_errors()
        logs = {"log_config": None} if json_logging() else {}  # JSON: uvicorn's records go through the root's
        config = uvicorn.Config(
            app, log_level="warning", access_log=access_log, lifespan="off", http=guarded_protocol(limits), **logs,
            backlog=ACCEPT_BATCH,
            timeout_keep_alive=limits.keep_alive, timeout_graceful_shutdown=1,
            **(dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.ca,
                    ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE) if tls else {}))
        if access_log:  # uvicorn set its loggers to log_level (warning): its access lines are INFO
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self.server, self.sock, self.in_flight, self.on_drain = (_Server(config, listen_backlog(limits)), sock,
                                                                 in_flight, on_drain)
        self.on_cut = on_cut
        self.scheme = "https" if tls else "http"
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    async def run(self) -> None:
        """Serve until drained; cancelled, stop at once (open requests get a second)."""
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            self.server.should_exit = True
            await self._task
            raise

    async def drain(self, grace: float, poll: float = 0.05) -> None:
        """503 to readiness and new generation requests; the requests in flight get up to ``grace`` seconds;
        then the listener closes and whatever is left is cut."""
        self.on_drain()
        deadline = time.monotonic() + grace
        if self.in_flight():
            log.info("HTTP: draining %d request(s) for up to %.0f s", self.in_flight(), grace)
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(poll)
        if self.in_flight():  # each answered as its client can read it, and logged (on_cut), before the listener goes
            log.info("HTTP: %d request(s) still running after the %.0f s grace are cut", self.on_cut(), grace)
            cut_by = time.monotonic() + CUT_SECONDS
            while self.in_flight() and time.monotonic() < cut_by:
                await asyncio.sleep(poll)
        self.server.should_exit = True
        if self._task is not None:
            await asyncio.shield(self._task)
