"""`specmesh serve`: the Generate gRPC service (and, with --http, the OpenAI-compatible HTTP API) over
remote verifiers and drafters, or over models in this process (--embedded).

Both front ends are shells over orchestrator/service.py's GenerationService: each request is data on the
engine core of one verifier replica (sticky for the request: it holds the KV cache; orchestrator/remote_loop.py
runs that core's steps), with its drafter candidates: the drafter replicas in least-loaded order, then a
local prompt-lookup proposer, which the core fails over along. The client's deadline bounds every hop;
a client that cancels ends its request, which releases the verifier session and closes the drafter stream.
The HTTP port's transport (TLS, timeouts, connection cap, drain on SIGTERM) is orchestrator/http_server.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from drafter_service.proposer import DEFAULT_PROPOSER, DEFAULT_PROPOSER_WHY, proposer_names, proposer_spec
from drafter_service.remote import DrafterClient
from orchestrator import http_api
from orchestrator.arguments import add_embedded_arguments, add_speculation_arguments, check_embedded_options
from orchestrator.http_server import HttpLimits, HttpServer, LoadingResponder, TlsFiles, bind
from orchestrator.metrics import ServeMetrics
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY
from orchestrator.service import (
    PROMPT_BYTES_PER_POSITION,
    Chunk,
    Final,
    GenerateRequest,
    GenerationService,
    Overloaded,
    RemoteBackend,
    request_id_of,
)
from orchestrator.stats import RequestStats, StepStats
from orchestrator.vllm_args import add_vllm_arguments, apply_vllm_arguments, served_names
from specmesh import models, rpc, serving
from specmesh.chat import ChatTemplate, ChatTemplateError
from specmesh.contract import CapacityError, TokenLogprobs, UnknownSessionError
from specmesh.metrics import MetricsAccess, add_metrics_argument, metrics_address, start_metrics_server
from specmesh.probes import ProbeServer
from specmesh.text_tokenizer import load_text_tokenizer
from specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specmesh.wire import GENERATE_SERVICE, logprobs_to_proto, sampling_from_proto
from verifier_service.arguments import DEFAULT_KV_CACHE_MEMORY
from verifier_service.remote import VerifierClient

log = logging.getLogger("specmesh.serve")


def client_status(exc: rpc.UpstreamError, request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for a failed call of ours to a verifier: its own credentials were
    fine, so an auth failure between services is an INTERNAL misconfiguration, not UNAUTHENTICATED. The text
    names no replica (``rpc.client_message``); the request's log line has the whole under ``request_id``."""
    message = rpc.client_message(exc, request_id)
    if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return grpc.StatusCode.INTERNAL, f"serve could not authenticate to an upstream service: {message}"
    return exc.code, message


def step_to_proto(step: StepStats) -> common_pb2.StepStats:
    return common_pb2.StepStats(
        num_proposed=step.num_proposed, tree_depth=step.tree_depth, num_accepted=step.num_accepted,
        accepted_sources=step.accepted_sources, draft_ms=step.draft_seconds * 1e3,
        verify_ms=step.verify_seconds * 1e3, draft_error=step.draft_error, budget_nodes=step.budget[0],
        budget_depth=step.budget[1], predrafted=step.predrafted, wait_ms=step.wait_seconds * 1e3,
        step_ms=step.step_seconds * 1e3, drafter_busy_ms=step.drafter_busy_seconds * 1e3,
        predraft_nodes=step.predraft_nodes, predraft_used=step.predraft_used,
        proposed_per_source=Counter(step.proposed_sources),
    )


def stats_to_proto(stats: RequestStats) -> generate_pb2.RequestStats:
    return generate_pb2.RequestStats(
        prompt_tokens=stats.prompt_tokens, generated_tokens=stats.num_generated, steps=stats.num_steps,
        tau=stats.tau, tokens_per_second=stats.tokens_per_second, total_seconds=stats.total_seconds,
        acceptance_per_position=stats.acceptance_per_position(), draft_errors=stats.num_draft_errors,
        acceptance=stats.acceptance, lossy=stats.lossy,
    )


def request_from_proto(request: generate_pb2.GenerateRequest) -> GenerateRequest:
    """The wire request as the service's GenerateRequest; ValueError for bad sampling parameters."""
    which = request.WhichOneof("input")
    if which is None:
        raise ValueError("set either prompt or token_ids")
    budget, spec = request.spec.budget, request.spec
    return GenerateRequest(
        sampling=sampling_from_proto(request.sampling),
        prompt=request.prompt if which == "prompt" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        proposer=spec.proposer or None,
        max_nodes=budget.max_nodes if budget.HasField("max_nodes") else None,
        max_depth=budget.max_depth if budget.HasField("max_depth") else None,
        overlap=spec.overlap if spec.HasField("overlap") else None,
        policy=spec.policy or None,
        restart_depth=spec.restart_depth if spec.HasField("restart_depth") else None,
    )


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    """The Generate gRPC service: a shell over the GenerationService every front end shares."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def _items(self, request, context) -> AsyncIterator[Chunk | Final]:
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            plan = await self.service.prepare(request_from_proto(request))
            async for item in self.service.stream(plan, deadline):
                yield item
        except (Overloaded, CapacityError) as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, rpc.redact(str(exc)))
        except rpc.UpstreamError as exc:
            await context.abort(*client_status(exc, request_id_of(exc)))
        except UnknownSessionError as exc:  # the verifier restarted or reaped the session
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                rpc.with_request_id("the verifier lost the session", request_id_of(exc)))
        except ValueError as exc:  # a bad request, or one the verifier rejected (e.g. past its context)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, rpc.redact(str(exc)))
        except Exception as exc:  # a bug: say so instead of an opaque UNKNOWN (the log has the traceback)
            log.exception("request %s failed", request_id_of(exc) or "(before admission)")
            await context.abort(grpc.StatusCode.INTERNAL,
                                rpc.with_request_id(f"internal error ({type(exc).__name__})", request_id_of(exc)))

    async def GenerateStream(self, request, context):
        async for item in self._items(request, context):
            if isinstance(item, Final):
                yield generate_pb2.GenerateChunk(text=item.text, finish_reason=item.result.finish_reason)
            else:
                chunk = generate_pb2.GenerateChunk(token_ids=item.token_ids, text=item.text)
                if item.step is not None:
                    chunk.step.CopyFrom(step_to_proto(item.step))
                if item.logprobs is not None:
                    chunk.logprobs.CopyFrom(logprobs_to_proto(item.logprobs))
                yield chunk

    async def Generate(self, request, context):
        response, logprobs = generate_pb2.GenerateResponse(), []
        async for item in self._items(request, context):
            response.text += item.text
            if isinstance(item, Final):
                response.finish_reason = item.result.finish_reason
                response.stats.CopyFrom(stats_to_proto(item.result.stats))
            else:
                response.token_ids.extend(item.token_ids)
                logprobs.append(item.logprobs)
        if (joined := TokenLogprobs.join(logprobs)) is not None:
            response.logprobs.CopyFrom(logprobs_to_proto(joined))
        return response


# ---------------------------------------------------------------------- CLI
DEFAULT_LISTEN = "127.0.0.1:50050"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="serve this model in this process with the OpenAI-compatible API on --host/--port, as "
                        "`vllm serve MODEL` does: a local Hugging Face directory, a .gguf file or ORG/NAME on the hub (from its "
                        "local cache, downloaded when missing); the same as --embedded --target MODEL --http "
                        "HOST:PORT, with the gRPC port only when --listen asks for it")
    p.add_argument("--host", default=None,
                   help=f"with MODEL: the HTTP API's address (default: {DEFAULT_HOST}; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=models.int_at_least(0), default=None,
                   help=f"with MODEL: the HTTP API's port (default: {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--listen", default=None,
                   help=f"address of the gRPC Generate service (default: {DEFAULT_LISTEN}; with MODEL: none unless "
                        "given)")
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API here (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /tokenize, /detokenize, /version, /health, /readyz, /livez, /load, /metrics); default: off (with MODEL: "
                        "--host:--port)")
    p.add_argument("--model-name", default=None,
                   help="the model's id in the HTTP API (the `model` field requests must name) and in traces and "
                        "metrics (default: MODEL or --target as given for a hub id, the directory's name for a "
                        "local one, `demo` for the bundled demo pair)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template of /v1/chat/completions: a Jinja file or the template itself (default: "
                        "the model's, from chat_template.jinja or tokenizer_config.json)")
    p.add_argument("--verifier", action="append", default=[], metavar="HOST:PORT",
                   help="a verifier replica (repeatable); each request sticks to one, least-loaded first")
    p.add_argument("--drafter", action="append", default=[], metavar="HOST:PORT",
                   help="a drafter replica (repeatable); least-loaded first, failing over to the next, then to "
                        "local prompt lookup, then to plain decoding")
    p.add_argument("--proposer", default=DEFAULT_PROPOSER,
                   choices=[n for n in proposer_names() if not proposer_spec(n).lossy] + ["none"],
                   help=f"proposer for requests that name none; never a lossy one (mjsd: requests ask for it by "
                        f"name) (default: {DEFAULT_PROPOSER}: {DEFAULT_PROPOSER_WHY})")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory for text prompts (default: the bundled demo target's when the verifiers "
                        "serve the demo model, else required; --embedded: the target's)")
    p.add_argument("--draft-timeout-ms", type=float, default=1000.0,
                   help="a drafter that answers a step later than this is failed over (default: 1000)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait at start-up for every verifier to answer (default: 60)")
    p.add_argument("--max-concurrent", type=models.positive_int, default=64,
                   help="requests in flight, beside --max-queued: beyond their sum, RESOURCE_EXHAUSTED / HTTP 429 "
                        "(how many decode at once is the verifiers' KV pool's to say; default: 64)")
    p.add_argument("--max-prompt-bytes", type=models.positive_int, default=None, metavar="BYTES",
                   help="refuse a text prompt larger than this before tokenizing it (default: "
                        f"{PROMPT_BYTES_PER_POSITION} bytes per position of the model's context)")
    p.add_argument("--max-queued", type=models.int_at_least(0), default=256,
                   help="requests waiting beyond --max-concurrent; more get RESOURCE_EXHAUSTED / HTTP 429 "
                        "(default: 256)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="HTTP API: seconds a request may run before it is cut off (default: none; gRPC clients "
                        "set their own deadline)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request (default: one INFO line on the specmesh.requests logger: "
                        "id, finish reason, token counts, sampling parameters, proposer, tau, time to first token, "
                        "duration)")
    h = p.add_argument_group("HTTP port", "limits of --http (its TLS is the gRPC port's --tls-cert/--tls-key/"
                                          "--tls-ca: HTTPS, with client certificates when --tls-ca is given)")
    h.add_argument("--http-read-timeout", type=models.positive_float, default=HttpLimits.read_timeout,
                   metavar="SECONDS", help="a request's headers and body must arrive within this many seconds of "
                                           f"its first byte, else the connection closes (default: "
                                           f"{HttpLimits.read_timeout:g})")
    h.add_argument("--access-log", action="store_true",
                   help="log every HTTP request (uvicorn's access log: client, method, path, status) on the "
                        "uvicorn.access logger (default: off; the per-request line of specmesh.requests stays)")
    h.add_argument("--http-keep-alive", type=models.positive_float, default=HttpLimits.keep_alive,
                   metavar="SECONDS", help=f"idle keep-alive connections close after this (default: "
                                           f"{HttpLimits.keep_alive:g})")
    h.add_argument("--http-max-connections", type=models.positive_int, default=HttpLimits.max_connections,
                   metavar="N", help="open HTTP connections at most; more are closed as they are accepted "
                                     f"(default: {HttpLimits.max_connections}, lowered to fit the open-file limit)")
    h.add_argument("--http-insecure", action="store_true",
                   help="serve --http in plaintext even though --tls-cert secures gRPC (e.g. behind a proxy that "
                        "terminates TLS); without it the HTTP port uses the same certificate")
    p.add_argument("--health", type=metrics_address, default=None, metavar="HOST:PORT",
                   help="also answer the health probes (/health = /readyz, /livez) here, on a listener of their own "
                        "(own thread, own accept queue: a connection storm on the API ports cannot fail them), "
                        "plaintext and open, telling nothing but up or down: point Kubernetes' probes here "
                        "(default: off; the HTTP API answers them too)")
    add_vllm_arguments(p)
    add_metrics_argument(p)
    add_speculation_arguments(p)  # defaults for requests whose SpecParams leave them unset
    serving.add_server_arguments(p)
    serving.add_upstream_arguments(p)
    g = p.add_argument_group("embedded", "--embedded: run the target (and draft) in this process instead of "
                                         "calling verifier and drafter replicas: one command serves a model")
    g.add_argument("--embedded", action="store_true", help="serve models loaded in this process (no --verifier)")
    add_embedded_arguments(g)
    g.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="memory of the embedded verifier's paged KV pool, the one pool of its engine core (default: "
                        "on CUDA, sized by --kv-cache-memory; elsewhere 2, or less when 64 sessions at full context "
                        "need less)")
    g.add_argument("--kv-cache-memory", type=float, default=DEFAULT_KV_CACHE_MEMORY, metavar="FRACTION",
                   help=f"on CUDA without --kv-cache-gb: the share of the device's memory this process may use, the "
                        f"KV pool taking what the weights, the draft's pool and a profiled forward leave of it, as "
                        f"`specmesh verifier` (default: {DEFAULT_KV_CACHE_MEMORY:g})")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="the embedded verifier computes every prompt whole (default: identical prompt prefixes "
                        "share their KV blocks, as `specmesh verifier`)")


def load_tokenizer(args: argparse.Namespace, verifier_model: str):
    """The tokenizer of text prompts: --tokenizer, else the demo target's when the verifiers serve the demo model
    (their Info names the model, never its directory); (its directory, the tokenizer). SystemExit asking for
    --tokenizer for any other model: a wrong vocabulary would turn every prompt into other tokens."""
    path = args.tokenizer
    if path is None:
        if verifier_model not in ("", "demo"):
            raise SystemExit(f"specmesh {args.command}: the verifiers serve {verifier_model!r}: give its tokenizer "
                             "directory with --tokenizer DIR")
        path = models.demo_model("target")
    log.info("tokenizer: %s", path)
    return path, load_text_tokenizer(path)  # without transformers where it can: serve runs no model


def _upstream_hint(exc: rpc.UpstreamError, upstream: rpc.Security) -> str:
    """What to check when a verifier did not answer Info: a TLS handshake a verifier refuses (no client
    certificate for one that requires it, an unknown CA) shows only as UNAVAILABLE or a deadline."""
    if exc.code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED):
        return ""
    hint = (" (serve's own credentials for verifiers and drafters: --upstream-token-file or "
            f"${rpc.UPSTREAM_TOKEN_ENV}, --upstream-tls-ca/-cert/-key")
    if exc.code != grpc.StatusCode.UNAUTHENTICATED:
        if upstream.ca is None and upstream.cert is None:
            hint += "; a verifier that listens with TLS needs --upstream-tls-ca"
        elif upstream.cert is None:
            hint += ("; a verifier started with --tls-ca requires a client certificate: --upstream-tls-cert "
                     "and --upstream-tls-key")
    return hint + ")"


def _remote_backend(args: argparse.Namespace, security: rpc.Security):
    """The verifier and drafter replicas of --verifier / --drafter: (backend, tokenizer directory, tokenizer)."""
    upstream = serving.upstream_security(args, security)  # the client's credentials are never forwarded
    verifiers = [VerifierClient(a, upstream) for a in args.verifier]
    infos = []
    for client in verifiers:
        try:
            infos.append(client.fetch_info(args.connect_timeout))
        except rpc.UpstreamError as exc:
            raise SystemExit(f"specmesh serve: {exc}{_upstream_hint(exc, upstream)}") from None
    if len({i.vocab_size for i in infos}) > 1:
        raise SystemExit("specmesh serve: the verifiers serve models with different vocabularies")
    drafters = [DrafterClient(a, upstream) for a in args.drafter]
    for client in drafters:
        try:
            info = client.info(timeout=2.0)
            log.info("drafter %s: proposers %s", client.address, ", ".join(info.proposers))
            if info.vocab_size and info.vocab_size != infos[0].vocab_size:
                raise SystemExit(f"specmesh serve: drafter {client.address} has vocabulary {info.vocab_size}, "
                                 f"the verifiers {infos[0].vocab_size}")
        except grpc.RpcError as exc:  # drafters may come later; failover covers their absence
            log.warning("drafter %s not reachable yet (%s)", client.address, exc.code().name)
    backend = RemoteBackend(verifiers, drafters, min(i.max_tree_nodes for i in infos), args.draft_timeout_ms / 1000,
                            infos[0].model)
    return (backend, *load_tokenizer(args, infos[0].model))


def _embedded_backend(args: argparse.Namespace):
    """Models in this process (--embedded): (backend, tokenizer directory, tokenizer)."""
    check_embedded_options(args)  # before the imports below: a bad path or device is told in a second
    from orchestrator.embedded import EmbeddedBackend, load_stack

    stack = load_stack(args)
    path = args.tokenizer or stack.target_dir
    tokenizer = load_text_tokenizer(path) if args.tokenizer else stack.tokenizer
    return EmbeddedBackend(stack, args.draft_timeout_ms / 1000), path, tokenizer


def build_service(args: argparse.Namespace, backend, tokenizer, model_name: str,
                  metrics: ServeMetrics) -> GenerationService:
    """The GenerationService `serve`'s options describe (also the Ray Serve orchestrator's)."""
    proposer = None if args.proposer == "none" else args.proposer
    speculative = getattr(args, "speculative", None)  # --speculative-config's budget
    budget = (speculative.max_nodes, speculative.max_depth) if speculative is not None else (None, None)
    return GenerationService(backend, tokenizer, model_name, proposer, args.max_concurrent, args.max_queued,
                             default_budget=budget,
                             overlap=bool(args.overlap if args.overlap is not None else DEFAULT_OVERLAP),
                             policy=args.policy or DEFAULT_POLICY, restart_depth=args.restart_depth,
                             max_prompt_bytes=args.max_prompt_bytes, metrics=metrics,
                             log_requests=not args.disable_log_requests)


def resolve_addresses(args: argparse.Namespace) -> None:
    """MODEL, --host/--port, --http, --listen as one picture: MODEL means --embedded --target MODEL with HTTP on
    --host:--port (127.0.0.1:8000) and gRPC only when --listen is given; otherwise gRPC on --listen (default
    127.0.0.1:50050) and HTTP with --http or --host/--port."""
    if args.model is not None:
        if args.target is not None or args.verifier:
            raise SystemExit("specmesh serve: MODEL serves that model in this process: drop --target/--verifier")
        args.embedded, args.target = True, args.model
    elif args.listen is None:
        args.listen = DEFAULT_LISTEN
    if args.host is not None or args.port is not None or args.model is not None:
        if args.http:
            raise SystemExit("specmesh serve: give the HTTP address as --http HOST:PORT or as --host/--port, not both")
        host = args.host or DEFAULT_HOST
        args.http = f"{f'[{host}]' if ':' in host else host}:{DEFAULT_PORT if args.port is None else args.port}"


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args)
    serving.setup_tracing(args)  # before any server or channel
    apply_vllm_arguments(args)  # vLLM's flags as specmesh's options (orchestrator/vllm_args.py)
    resolve_addresses(args)
    if args.embedded == bool(args.verifier):
        raise SystemExit("specmesh serve: give a MODEL to serve, the verifier replicas (--verifier HOST:PORT, "
                         "repeatable) or --embedded to run the bundled demo pair in this process")
    if not args.embedded and args.target is not None:
        raise SystemExit("specmesh serve: --target is an --embedded option (the verifiers load the model)")
    security = serving.server_security(args)
    if args.api_keys:  # --api-key: more bearer tokens, beside --token-file's
        security = dataclasses.replace(security, tokens=tuple(dict.fromkeys(security.tokens + args.api_keys)))
    http_socket = None
    if args.http:  # bound first: a port in use is reported before any model is loaded
        try:
            http_socket = bind(args.http)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"specmesh serve: HTTP {args.http}: {exc}") from None
    if args.listen and not args.reuse_port:  # the same for the gRPC port
        try:
            serving.check_port_free(args.listen)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"specmesh serve: --listen {args.listen}: {exc}") from None
    probes = None
    if args.health:  # answering at once: /livez 200, readiness 503 until the service is built
        try:
            probes = ProbeServer(args.health).start()
        except (OSError, ValueError) as exc:
            raise SystemExit(f"specmesh serve: --health {args.health}: {exc}") from None
    loading = contextlib.ExitStack()
    if http_socket is not None and (security.cert is None or args.http_insecure):  # plaintext: probes answered
        loading.enter_context(LoadingResponder(http_socket))  # /livez 200, the rest 503, while it loads
    with loading:
        service, http = _build(args, security, http_socket)
    drain = None
    if probes is not None:
        probes.serve_readiness(lambda: None if service.healthy() else "no verifier is serving")

        async def drain(grace: float) -> None:  # readiness 503 on the probe port as on the API's
            probes.drain()
            if http is not None:
                await http.drain(grace)
    elif http is not None:
        drain = http.drain
    if not args.listen:  # MODEL without --listen: the HTTP API alone
        return serving.serve_http_only(args, http.run, drain, http_socket.getsockname()[1])
    log.info("gRPC Generate service on %s%s", args.listen, "" if http else " (no HTTP API: --http or --port)")
    return serving.serve(args, security, GenerateServicer(service), generate_pb2_grpc.add_GenerateServicer_to_server,
                         GENERATE_SERVICE, http and http.run, drain)


def _build(args: argparse.Namespace, security: rpc.Security, http_socket) -> tuple[GenerationService, HttpServer | None]:
    """The backend (models loaded and warm, or replicas reached), the service over it and the HTTP server on
    ``http_socket`` (None: no HTTP API)."""
    backend, tokenizer_dir, tokenizer = _embedded_backend(args) if args.embedded else _remote_backend(args, security)
    if args.max_model_len is not None:  # vLLM's --max-model-len: the context served, capped (checked before warm-up)
        if args.max_model_len > backend.info.max_positions:
            raise SystemExit(f"specmesh serve: --max-model-len {args.max_model_len} is longer than the context "
                             f"served ({backend.info.max_positions} positions)")
        backend.info = dataclasses.replace(backend.info, max_positions=args.max_model_len)
    if args.embedded:  # before any port answers: /health's 200 (and gRPC's SERVING) mean a request is served now
        seconds = backend.warm_up(None if args.proposer == "none" else args.proposer)
        log.info("warmed up in %.1f s (the engine core, one request with %s and one plain)", seconds, args.proposer)
    names = served_names(args, models.served_name(args.target if args.embedded else backend.model or tokenizer_dir))
    model_name = names[0]
    metrics = ServeMetrics(model_name)
    backend.register_metrics(metrics.registry, model_name)
    service = build_service(args, backend, tokenizer, model_name, metrics)
    if args.metrics:
        start_metrics_server(args.metrics, metrics.registry, MetricsAccess.of(args, security.tokens))
    http = None
    if http_socket is not None:
        try:
            chat = ChatTemplate.load(tokenizer_dir, args.chat_template)
        except ChatTemplateError as exc:
            raise SystemExit(f"specmesh serve: {exc}") from None
        app = http_api.build_app(service, chat, security.tokens, args.request_timeout, model_names=names,
                                 tool_parser=args.tool_parser)
        if args.embedded:  # the HTTP path's first calls too, in process, before the port answers
            statuses = http_api.warm_up(app)
            if any(status != 200 for status in statuses):
                log.warning("the HTTP warm-up's requests answered %s", statuses)
        http = HttpServer(app, http_socket, HttpLimits(args.http_read_timeout, args.http_keep_alive,
                                                       args.http_max_connections),
                          http_tls(args, security), in_flight=lambda: app.state.api.in_flight,
                          on_drain=app.state.api.drain, access_log=args.access_log, on_cut=app.state.api.cut)
        log.info("OpenAI-compatible API on %s/v1 (chat template: %s%s)", http.url, "yes" if chat else "none",
                 ", bearer token required" if security.tokens else "")
    return service, http


def http_tls(args: argparse.Namespace, security: rpc.Security) -> TlsFiles | None:
    """The HTTP port's TLS: the gRPC port's certificate, unless --http-insecure says plaintext on purpose."""
    if security.cert is None:
        return None
    if args.http_insecure:
        log.warning("--http-insecure: the HTTP port is plaintext%s while gRPC uses TLS",
                    "" if security.tokens else " and unauthenticated")
        return None
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
