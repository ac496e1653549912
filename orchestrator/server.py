"""`specmesh serve`: the Generate gRPC service over remote verifiers and drafters.

Each request runs the same Engine as embedded mode, on a worker thread, wired to
one verifier replica (sticky for the request: it holds the KV cache) and to its
drafter candidates: the drafter replicas in least-loaded order, then a local
prompt-lookup proposer, which the engine fails over along. The client's deadline
bounds every hop; a client that cancels stops the engine, which releases the
verifier session and closes the drafter stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import DEFAULT_PROPOSER, DEFAULT_PROPOSER_WHY, make_proposer, proposer_names
from drafter_service.remote import DrafterClient
from orchestrator.arguments import add_speculation_arguments
from orchestrator.engine import Engine, GenerationResult
from orchestrator.policy import (
    DEFAULT_OVERLAP,
    DEFAULT_POLICY,
    SpeculationPolicy,
    build_policy,
    load_aware,
    resolve_budget,
)
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import TextStream
from specmesh import models, rpc, serving
from specmesh.contract import UnknownSessionError
from specmesh.sampling import SamplingParams
from specmesh.text_tokenizer import load_text_tokenizer
from specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specmesh.wire import GENERATE_SERVICE, sampling_from_proto
from verifier_service.remote import VerifierClient

log = logging.getLogger("specmesh.serve")
_DONE = object()


def least_loaded(clients: Sequence, rng: random.Random) -> list:
    """Clients ordered by the sessions they serve now; ties in random order."""
    return sorted(clients, key=lambda c: (c.num_sessions, rng.random()))


def client_status(exc: rpc.UpstreamError) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for a failed call of ours to a verifier: its own credentials were
    fine, so an auth failure between services is an INTERNAL misconfiguration, not UNAUTHENTICATED."""
    if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return grpc.StatusCode.INTERNAL, f"serve could not authenticate to an upstream service: {exc}"
    return exc.code, str(exc)


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
    )


@dataclass(frozen=True)
class _Plan:
    """A Generate request, checked, with the server's defaults filled in."""

    prompt: list[int]
    sampling: SamplingParams
    proposer: str | None  # None = plain decoding
    max_nodes: int  # of the budget (0 = no drafter)
    overlap: bool
    policy: SpeculationPolicy  # carries the budget


# a token of a byte-level BPE covers a few bytes on average (up to ~16 for long code identifiers): a text
# prompt of more bytes than this per context position cannot fit, whatever it says
PROMPT_BYTES_PER_POSITION = 32

class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(
        self,
        verifiers: Sequence[VerifierClient],
        drafters: Sequence[DrafterClient],
        tokenizer,
        default_proposer: str | None = DEFAULT_PROPOSER,
        draft_timeout: float = 1.0,
        max_concurrent: int = 64,
        max_queued: int = 256,
        max_tree_nodes: int = 256,
        overlap: bool = DEFAULT_OVERLAP,
        policy: str = DEFAULT_POLICY,
        restart_depth: int | None = None,
        max_prompt_bytes: int | None = None,
    ) -> None:
        """``max_prompt_bytes``: a text prompt longer than this (UTF-8) is refused before it is tokenized;
        None = PROMPT_BYTES_PER_POSITION per position of the verifiers' context."""
        self.verifiers = list(verifiers)
        self.overlap, self.policy, self.restart_depth = overlap, policy, restart_depth  # for requests that do not choose
        self.drafters = list(drafters)
        self.tokenizer = tokenizer
        self.info = self.verifiers[0].info
        self.max_positions = min(v.info.max_positions for v in self.verifiers)
        self.max_prompt_bytes = max_prompt_bytes or PROMPT_BYTES_PER_POSITION * self.max_positions
        self.default_proposer = default_proposer
        self.draft_timeout = draft_timeout
        self._local = LocalDrafter(make_proposer("prompt_lookup"))  # last resort before plain decoding
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="engine")
        self.max_requests = max_concurrent + max_queued  # beyond this: RESOURCE_EXHAUSTED
        self.max_tree_nodes = max_tree_nodes  # the verifiers' limit: larger budgets are clamped
        self.num_requests = 0  # touched only on the event loop
        self._rng = random.Random()

    # ------------------------------------------------------------- requests
    def _parse(self, request):
        """The request checked and resolved against this server's defaults, or ValueError."""
        # sizes first: a prompt that cannot fit the context is refused before it costs tokenizing or a hop
        if request.WhichOneof("input") == "prompt":
            if not request.prompt:
                raise ValueError("empty prompt")
            size = len(request.prompt)  # characters: a lower bound of the UTF-8 bytes, free to read
            if size > self.max_prompt_bytes or len(request.prompt.encode()) > self.max_prompt_bytes:
                raise ValueError(f"the prompt has over {self.max_prompt_bytes} bytes, more than the verifiers' "
                                 f"context of {self.max_positions} tokens can hold (--max-prompt-bytes)")
            prompt = list(self.tokenizer.encode(request.prompt))
        elif request.WhichOneof("input") == "token_ids":
            if len(request.token_ids.ids) > self.max_positions:
                raise ValueError(f"the prompt has {len(request.token_ids.ids)} tokens; the verifiers' context is "
                                 f"{self.max_positions}")
            prompt = list(request.token_ids.ids)
        else:
            raise ValueError("set either prompt or token_ids")
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.info.vocab_size})")
        sampling = sampling_from_proto(request.sampling)
        if len(prompt) + sampling.max_new_tokens > self.max_positions:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                             f"verifiers' context of {self.max_positions} positions")
        proposer = request.spec.proposer or self.default_proposer
        if proposer in ("none", "ar"):
            proposer = None
        if proposer is not None and proposer not in proposer_names():
            raise ValueError(f"unknown proposer {proposer!r}; choose from {', '.join(proposer_names())}, none")
        budget = request.spec.budget
        nodes, depth = resolve_budget(proposer, budget.max_nodes if budget.HasField("max_nodes") else None,
                                      budget.max_depth if budget.HasField("max_depth") else None, self.max_tree_nodes)
        overlap = request.spec.overlap if request.spec.HasField("overlap") else self.overlap
        restart = request.spec.restart_depth if request.spec.HasField("restart_depth") else self.restart_depth
        policy = build_policy(request.spec.policy or self.policy, nodes, depth, self.draft_timeout, restart)
        return _Plan(prompt, sampling, proposer, nodes, overlap, policy)

    def _engine(self, verifier: VerifierClient, plan: _Plan, deadline) -> Engine:
        """The request's engine: its verifier, and its drafter candidates (the drafter replicas, least-loaded
        first, then prompt lookup in this process), which the engine fails over along."""
        candidates = []
        if plan.proposer is not None and plan.max_nodes > 0:
            candidates = [(f"drafter {c.address}", lambda c=c: c.drafter(plan.proposer, deadline))
                          for c in least_loaded(self.drafters, self._rng)]
            candidates.append(("local prompt_lookup", lambda: self._local))
        policy = load_aware(plan.policy, verifier.costs)  # trees sized for this replica's load
        return Engine(verifier.bind(deadline), candidates, policy, self._decode, overlap=plan.overlap)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _run(self, plan: _Plan, deadline, cancelled: threading.Event, emit) -> tuple[GenerationResult, str]:
        """Worker thread: run the engine, calling ``emit(event, text)`` per step; returns the result and the
        text not yet emitted. A verifier that fails before anything was emitted is replaced by the next
        one; later failures end the request."""
        sampling = plan.sampling
        for attempt, verifier in enumerate(least_loaded(self.verifiers, self._rng)):
            if cancelled.is_set():  # gone while queued: do not even prefill
                return GenerationResult([], "aborted", RequestStats()), ""
            result = GenerationResult([], "", RequestStats())
            text = TextStream(self._decode, sampling.stop)
            emitted = False
            engine = self._engine(verifier, plan, deadline)
            try:
                with contextlib.closing(engine.stream(plan.prompt, sampling, result)) as events:
                    for event in events:
                        emitted = True
                        emit(event, text.push(event.tokens, result.text_limit))
                        if cancelled.is_set():
                            break  # closing the stream releases the verifier session and the drafter
                return result, text.flush(result.text_limit)
            except rpc.UpstreamError as exc:
                last = attempt == len(self.verifiers) - 1
                if emitted or last or exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                log.warning("verifier %s %s before the first token; trying another", verifier.address,
                            "full" if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "unavailable")
        raise AssertionError("unreachable")

    async def _chunks(self, request, context):
        """The request's GenerateChunks as steps commit, then (GenerationResult, text not yet sent)."""
        if self.num_requests >= self.max_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.num_requests} requests in flight or queued; try again later")
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(event, text: str) -> None:
            chunk = generate_pb2.GenerateChunk(token_ids=event.tokens, text=text)
            if event.step is not None:
                chunk.step.CopyFrom(step_to_proto(event.step))
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        def work() -> tuple[GenerationResult, str]:
            try:  # tokenizing happens here too: a huge prompt must not stall the event loop
                return self._run(self._parse(request), deadline, cancelled, emit)
            finally:
                loop.call_soon_threadsafe(chunks.put_nowait, _DONE)

        self.num_requests += 1
        future = loop.run_in_executor(self._executor, work)
        try:
            while (chunk := await chunks.get()) is not _DONE:
                yield chunk
            yield await future
        except rpc.UpstreamError as exc:
            await context.abort(*client_status(exc))
        except UnknownSessionError as exc:  # the verifier restarted or reaped the session
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the verifier lost the session: {exc}")
        except ValueError as exc:  # a bad request, or one the verifier rejected (e.g. past its context)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a bug: say so instead of an opaque UNKNOWN
            log.exception("request failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            self.num_requests -= 1
            cancelled.set()  # the client went away, or we are done: the engine stops at its next step

    async def GenerateStream(self, request, context):
        async for item in self._chunks(request, context):
            if isinstance(item, tuple):
                result, tail = item
                yield generate_pb2.GenerateChunk(text=tail, finish_reason=result.finish_reason)
            else:
                yield item

    async def Generate(self, request, context):
        response = generate_pb2.GenerateResponse()
        async for item in self._chunks(request, context):
            if isinstance(item, tuple):
                result, tail = item
                response.text += tail
                response.finish_reason = result.finish_reason
                response.stats.CopyFrom(stats_to_proto(result.stats))
            else:
                response.token_ids.extend(item.token_ids)
                response.text += item.text
        return response


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50050", help="address to serve on (default: 127.0.0.1:50050)")
    p.add_argument("--verifier", action="append", required=True, metavar="HOST:PORT",
                   help="a verifier replica (repeatable); each request sticks to one, least-loaded first")
    p.add_argument("--drafter", action="append", default=[], metavar="HOST:PORT",
                   help="a drafter replica (repeatable); least-loaded first, failing over to the next, then to "
                        "local prompt lookup, then to plain decoding")
    p.add_argument("--proposer", default=DEFAULT_PROPOSER, choices=proposer_names() + ["none"],
                   help=f"proposer for requests that name none (default: {DEFAULT_PROPOSER}: {DEFAULT_PROPOSER_WHY})")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory for text prompts (default: the verifier's model directory when it "
                        "exists here, else the bundled demo target's)")
    p.add_argument("--draft-timeout-ms", type=float, default=1000.0,
                   help="a drafter that answers a step later than this is failed over (default: 1000)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait at start-up for every verifier to answer (default: 60)")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests decoded at once (default: 64)")
    p.add_argument("--max-prompt-bytes", type=models.positive_int, default=None, metavar="BYTES",
                   help="refuse a text prompt larger than this before tokenizing it (default: "
                        f"{PROMPT_BYTES_PER_POSITION} bytes per position of the verifiers' context)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting beyond --max-concurrent; more get RESOURCE_EXHAUSTED (default: 256)")
    add_speculation_arguments(p)  # defaults for requests whose SpecParams leave them unset
    serving.add_server_arguments(p)
    serving.add_upstream_arguments(p)


def _load_tokenizer(args: argparse.Namespace, verifier_model: str):
    path = args.tokenizer
    if path is None:
        local = Path(verifier_model) if verifier_model else None
        path = local if local is not None and (local / "tokenizer.json").is_file() else models.demo_model("target")
    log.info("tokenizer: %s", path)
    return load_text_tokenizer(path)  # without transformers where it can: serve runs no model


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args)
    security = serving.server_security(args)
    upstream = serving.upstream_security(args, security)  # the client's credentials are never forwarded
    verifiers = [VerifierClient(a, upstream) for a in args.verifier]
    infos = []
    for client in verifiers:
        try:
            infos.append(client.fetch_info(args.connect_timeout))
        except rpc.UpstreamError as exc:
            hint = ""
            if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE):
                hint = (" (serve's own credentials for verifiers and drafters: --upstream-token-file or "
                        f"${rpc.UPSTREAM_TOKEN_ENV}, --upstream-tls-ca/-cert/-key)")
            raise SystemExit(f"specmesh serve: {exc}{hint}") from None
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
    tokenizer = _load_tokenizer(args, infos[0].model)
    proposer = None if args.proposer == "none" else args.proposer
    servicer = GenerateServicer(verifiers, drafters, tokenizer, proposer, args.draft_timeout_ms / 1000,
                                args.max_concurrent, args.max_queued, min(i.max_tree_nodes for i in infos),
                                overlap=bool(args.overlap if args.overlap is not None else DEFAULT_OVERLAP),
                                policy=args.policy or DEFAULT_POLICY, restart_depth=args.restart_depth,
                                max_prompt_bytes=args.max_prompt_bytes)
    return serving.serve(args, security, servicer, generate_pb2_grpc.add_GenerateServicer_to_server, GENERATE_SERVICE)
