"""Health probes on a listener of their own (`serve --health HOST:PORT`), out of the API's traffic.

A connection storm on the API port fills that port's accept queue and keeps its event loop busy accepting and
closing: a probe sent there waits behind the storm (SYN retransmits: seconds) and a load balancer or the kubelet
ejects a replica that is serving. This listener has its own socket, accept queue (``PROBE_BACKLOG``) and thread
(``http.server``'s: a few probes a second, no load), so the storm never reaches it:

- ``/livez``: 200 while the process answers (loading and draining too: a restart would not help);
- ``/health`` = ``/readyz``: 200 when ``readiness()`` says ready, else 503 with its reason in OpenAI's error shape,
  as the API port's /health answers: "loading" until the server says otherwise, then its check (a verifier up), and
  "shutting down" from ``drain`` on;
- anything else 404. No metrics, no load, no addresses: the port stays open to the kubelet without a token or a
  client certificate (which a kubelet's HTTP probe cannot present), telling nothing but up or down.

At most ``PROBE_CONNECTIONS`` are answered at once (one thread each, closed after ``PROBE_TIMEOUT`` seconds
without a request); more are closed as they are accepted.
"""

from __future__ import annotations

import http.server
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable

from specmesh.serving import split_host_port

log = logging.getLogger("specmesh.probes")

PROBE_BACKLOG = 16  # the probe listener's accept queue: a kubelet and a load balancer, a few probes each
PROBE_CONNECTIONS = 16  # answered at once; more are closed as they are accepted
PROBE_TIMEOUT = 5.0  # seconds a probe connection may take to send its request
LOADING = "the server is loading"
SHUTTING_DOWN = "the server is shutting down"


def error_body(message: str, code: str, kind: str = "server_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """``http.server``'s handler answering JSON on a connection that closes after it (``answer``), without a log
    line per request: the probe listener's and the API port's while it loads (orchestrator/http_server.py)."""

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, *args) -> None:  # probes are not worth a line each
        pass


class ProbeServer:
    """/livez, /health and /readyz on ``address`` (HOST:PORT; port 0: any free port), answered from a thread of
    their own from ``start`` on. ``readiness()`` returns None when ready, else why not; it runs on the probe's
    thread and must not block for long."""

    def __init__(self, address: str, backlog: int = PROBE_BACKLOG) -> None:
        host, port = split_host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=backlog)  # OSError: taken
        self._readiness: Callable[[], str | None] = lambda: LOADING
        self._draining = False
        self._slots = threading.BoundedSemaphore(PROBE_CONNECTIONS)
        probes = self

        class Handler(JsonHandler):
            timeout = PROBE_TIMEOUT  # a client that sends nothing gives its thread back

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path == "/livez":
                    self.answer(200, {"status": "alive"})
                elif path in ("/health", "/readyz"):
                    reason = probes.not_ready()
                    if reason is None:
                        self.answer(200, {"status": "ok"})
                    else:
                        self.answer(503, error_body(reason, "service_unavailable"))
                else:
                    self.answer(404, error_body(f"{path} is not served here: the probe port answers /health, "
                                                "/readyz and /livez", "not_found", "invalid_request_error"))

            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET()


        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

            def process_request(self, request, client_address) -> None:
                if not probes._slots.acquire(blocking=False):  # a flood on this port too: closed, not queued
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    probes._slots.release()

        self._server = Server(self.sock.getsockname()[:2], Handler, bind_and_activate=False)
        self._server.socket.close()  # (the unbound one it made)
        self._server.socket = self.sock
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="health-probes", daemon=True)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> ProbeServer:
        self._thread.start()
        host, port = self.sock.getsockname()[:2]
        log.info("health probes at http://%s:%d (/health, /readyz, /livez)", f"[{host}]" if ":" in host else host,
                 port)
        return self

    def serve_readiness(self, readiness: Callable[[], str | None]) -> None:
        """From now on readiness is ``readiness()`` (the server has loaded)."""
        self._readiness = readiness

    def drain(self) -> None:
        """Readiness 503 from now on: the process is shutting down."""
        self._draining = True

    def not_ready(self) -> str | None:
        """None when ready, else why not."""
        if self._draining:
            return SHUTTING_DOWN
        try:
            return self._readiness()
        except Exception as exc:  # noqa: BLE001 - a check that fails says not ready, with why
            log.warning("readiness check failed: %s", exc)
            return f"the readiness check failed: {type(exc).__name__}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
