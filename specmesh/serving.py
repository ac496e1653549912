"""Command-line pieces every specmesh server shares: security options, logging, readiness."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from specmesh import rpc


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Options every specmesh server shares: security, shutdown, readiness."""
    p.add_argument("--token-file", type=Path, default=None,
                   help=f"file holding the bearer token every call must carry (default: ${rpc.TOKEN_ENV}, "
                        "or no authentication when neither is set)")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM server certificate (enables TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA bundle: outgoing calls of `serve` trust it, and (see --tls-client-auth) clients must "
                        "present a certificate it signed (mutual TLS)")
    p.add_argument("--tls-client-auth", choices=("require", "none"), default="require",
                   help="with --tls-ca: 'require' client certificates signed by it (mutual TLS, the default), or "
                        "'none': --tls-ca only makes this server's own calls trust that CA (e.g. `serve` calling "
                        "verifiers whose certificates a private CA signed, for clients without certificates)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight calls get to finish after SIGTERM (default: 10)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound port to this file once serving (useful with --listen HOST:0)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share the --listen port with other processes (SO_REUSEPORT); by default a port in use is "
                        "an error")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def server_security(args: argparse.Namespace) -> rpc.Security:
    try:
        security = rpc.Security.load(token_file=args.token_file, cert=args.tls_cert, key=args.tls_key,
                                     ca=args.tls_ca)
        return dataclasses.replace(security, client_auth=args.tls_client_auth == "require")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None


def write_ready_file(path: Path | None):
    def on_started(port: int) -> None:
        if path is not None:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(path)  # atomic: readers never see a partial file

    return on_started


def setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def serve(
    args: argparse.Namespace,
    security: rpc.Security,
    servicer,
    add_to_server: Callable,
    service_name: str,
    background: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve ``servicer`` (registered with its generated ``add_..._to_server``) until SIGTERM/SIGINT;
    ``background()`` runs beside it and is cancelled at shutdown."""

    async def main() -> None:
        server = rpc.new_server(security, args.reuse_port)
        add_to_server(servicer, server)
        task = asyncio.ensure_future(background()) if background is not None else None
        try:
            await rpc.run_server(server, args.listen, security, [service_name], args.grace,
                                 write_ready_file(args.ready_file))
        finally:
            if task is not None:
                task.cancel()

    try:
        asyncio.run(main())
    except OSError as exc:  # cannot listen: one line, not a traceback
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    return 0
