"""Command-line pieces every specmesh server shares: security options, logging, readiness."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from specmesh import rpc, tracing
from specmesh.host_runtime import freeze_heap

log = logging.getLogger("specmesh.serve")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Options every specmesh server shares: security, shutdown, readiness."""
    p.add_argument("--token-file", type=Path, default=None,
                   help=f"file of the bearer tokens a call may carry, one per line (each is a separate caller: "
                        f"sessions belong to the caller that opened them); default: ${rpc.TOKEN_ENV}, or no "
                        "authentication when neither is set")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM server certificate (enables TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA bundle: callers must present a client certificate it signed (mutual TLS; the "
                        "certificate's common name is the caller's identity)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight calls get to finish after SIGTERM (default: 10)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound port to this file once serving (useful with --listen HOST:0)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share the --listen port with other processes (SO_REUSEPORT); by default a port in use is "
                        "an error")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text: one line per record (time, logger, level, message); json: one JSON object per line "
                        "(time, level, logger, message, exception), for log collectors (default: text)")
    p.add_argument("--trace-probes", action="store_true",
                   help="with tracing on (OTEL_* variables), trace health checks and the HTTP port's /metrics, "
                        "/health, /readyz, /livez and /load too (default: only requests; "
                        "OTEL_PYTHON_EXCLUDED_URLS, where set, lists the HTTP URLs left out instead)")


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT (``[::1]:PORT`` for IPv6; port 0-65535, 0 = any free); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0-65535, got {address!r}")
    return host, int(port)


def check_port_free(address: str) -> None:
    """OSError if HOST:PORT cannot be listened on (taken, or not this machine's): checked before a server loads
    its model, so a second server on a taken port fails in a second instead of after the load."""
    host, port = split_host_port(address)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen there: {exc.strerror} (another server on the port? --reuse-port shares "
                          "it)") from None


def server_security(args: argparse.Namespace) -> rpc.Security:
    """What the server's listener accepts (--token-file / $SPECMESH_TOKEN, --tls-*)."""
    try:
        return rpc.Security.load(token_file=args.token_file, cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None


def add_upstream_arguments(p: argparse.ArgumentParser) -> None:
    """Credentials of a server's own calls to other specmesh services (``serve`` -> verifiers, drafters):
    separate from what its clients present, which is never forwarded."""
    p.add_argument("--upstream-token-file", type=Path, default=None,
                   help=f"file holding the bearer token presented to verifiers and drafters (default: "
                        f"${rpc.UPSTREAM_TOKEN_ENV}, or none); must differ from every client token")
    p.add_argument("--upstream-tls-ca", type=Path, default=None,
                   help="PEM CA that signed the verifiers' and drafters' certificates (enables TLS to them; "
                        "default with --upstream-tls-cert: the system roots)")
    p.add_argument("--upstream-tls-cert", type=Path, default=None,
                   help="PEM client certificate presented to verifiers and drafters (mutual TLS)")
    p.add_argument("--upstream-tls-key", type=Path, default=None, help="PEM private key of --upstream-tls-cert")


def upstream_security(args: argparse.Namespace, server: rpc.Security) -> rpc.Security:
    """Credentials for the internal hops; refuses to start when they would let a client in upstream."""
    try:
        upstream = rpc.Security.load(token_file=args.upstream_token_file, cert=args.upstream_tls_cert,
                                     key=args.upstream_tls_key, ca=args.upstream_tls_ca,
                                     token_env=rpc.UPSTREAM_TOKEN_ENV)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    if upstream.token is not None and upstream.token in server.tokens:
        raise SystemExit(f"specmesh {args.command}: the upstream token is also a client token; give the "
                         "verifiers and drafters a token of their own, or every client could call them directly")
    return upstream


def write_ready_file(path: Path | None):
    def on_started(port: int) -> None:
        if path is not None:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(path)  # atomic: readers never see a partial file

    return on_started


async def wait_until_idle(sessions: Callable[[], int], timeout: float, poll: float = 0.1) -> bool:
    """Wait up to ``timeout`` seconds for ``sessions()`` to reach 0 (a draining server's open sessions); True if
    it did."""
    deadline = time.monotonic() + timeout
    while sessions() and time.monotonic() < deadline:
        await asyncio.sleep(poll)
    return not sessions()


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object per record, the fields a log collector indexes. Written here: the
    standard library's json does it in a dozen lines, not worth a dependency."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                     timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def json_logging() -> bool:
    """Whether the root logger writes JSON (``--log-format json``): other libraries' loggers (uvicorn's) then
    go through it instead of their own text handlers."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def setup_logging(args: argparse.Namespace) -> None:
    if getattr(args, "log_format", "text") == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=args.log_level, handlers=[handler])
    else:
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def setup_tracing(args: argparse.Namespace) -> bool:
    """OpenTelemetry tracing as the OTEL_* variables ask (off by default; ``specmesh.tracing``), with service name
    ``specmesh-<command>``; call it before any server or channel is made. True if on."""
    try:
        return tracing.setup_tracing(f"specmesh-{args.command}", trace_probes=getattr(args, "trace_probes", False))
    except tracing.TracingSetupError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None


def serve_http_only(args: argparse.Namespace, run: Callable[[], Awaitable[None]],
                    drain: Callable[[float], Awaitable[None]], port: int) -> int:
    """Run an HTTP server (``run()``) until SIGTERM/SIGINT, then ``drain(--grace)``; --ready-file gets
    ``port``."""

    async def main() -> None:
        server = asyncio.ensure_future(run())
        write_ready_file(args.ready_file)(port)
        if await rpc.until_signalled(server):
            log.info("shutting down: draining for up to %.0f s", args.grace)
            await drain(args.grace)
        await server

    freeze_heap()  # everything is built: the GC never walks it again (host_runtime.py)
    asyncio.run(main())
    return 0


def serve(
    args: argparse.Namespace,
    security: rpc.Security,
    servicer,
    add_to_server: Callable,
    service_name: str,
    background: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[float], Awaitable[None]] | None = None,
) -> int:
    """Serve ``servicer`` (registered with its generated ``add_..._to_server``) until SIGTERM/SIGINT;
    ``background()`` runs beside it and is cancelled at shutdown, after ``drain(grace)`` (run beside the gRPC
    drain) returned."""

    async def main() -> None:
        server = rpc.new_server(security, args.reuse_port)
        add_to_server(servicer, server)
        task = asyncio.ensure_future(background()) if background is not None else None
        try:
            await rpc.run_server(server, args.listen, security, [service_name], args.grace,
                                 write_ready_file(args.ready_file), also_drain=drain)
        finally:
            if task is not None:
                task.cancel()

    freeze_heap()  # everything is built: the GC never walks it again (host_runtime.py)
    try:
        asyncio.run(main())
    except OSError as exc:  # cannot listen: one line, not a traceback
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    return 0
