"""The request path every front end shares: check a request, admit it, run its engine on a worker thread,
stream its steps.

The gRPC ``Generate`` service (orchestrator/server.py) and the OpenAI-compatible HTTP API
(orchestrator/http_api.py) are shells over ``GenerationService``: each turns its request into a
``GenerateRequest``, awaits ``prepare`` (checks and tokenizes), iterates ``stream`` and maps the
exceptions below to its own status codes:

    ValueError                  bad input                       INVALID_ARGUMENT / 400
    Overloaded                  too many requests in flight     RESOURCE_EXHAUSTED / 429
    CapacityError               no KV room (embedded verifier)  RESOURCE_EXHAUSTED / 429
    rpc.UpstreamError           a verifier failed               its code (UNAVAILABLE / 503, ...)
    UnknownSessionError         the verifier lost the session   UNAVAILABLE / 503

Where the engines come from is a ``Backend``: verifier and drafter replicas over gRPC
(``RemoteBackend``, `specmesh serve --verifier ...`) or models in this process
(``orchestrator.embedded.EmbeddedBackend``, `specmesh serve --embedded`). Both build the same ``Engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import DEFAULT_PROPOSER, make_proposer, proposer_names
from drafter_service.remote import DrafterClient
from orchestrator.acceptance import acceptance_of, request_sampling
from orchestrator.engine import Engine, GenerationResult, StepEvent
from orchestrator.metrics import ServeMetrics
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, build_policy, load_aware, resolve_budget
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import TextStream
from specmesh import rpc, tracing
from specmesh.contract import ModelInfo
from specmesh.sampling import SamplingParams
from verifier_service.remote import VerifierClient

log = logging.getLogger("specmesh.serve")
_DONE = object()

# a token of a byte-level BPE covers a few bytes on average (up to ~16 for long code identifiers): a text
# prompt of more bytes than this per context position cannot fit, whatever it says
PROMPT_BYTES_PER_POSITION = 32


class Overloaded(Exception):
    """More requests in flight or queued than the server takes (--max-concurrent + --max-queued)."""


@dataclass(frozen=True)
class GenerateRequest:
    """A request as every front end states it. Unset speculation options take the server's defaults."""

    sampling: SamplingParams
    prompt: str | None = None  # text, tokenized by the server ...
    token_ids: Sequence[int] | None = None  # ... or token ids (exactly one of the two)
    proposer: str | None = None  # None = the server's default; "none" / "ar" = plain decoding
    max_nodes: int | None = None
    max_depth: int | None = None
    overlap: bool | None = None
    policy: str | None = None  # static | adaptive
    restart_depth: int | None = None
    operation: str = "text_completion"  # what the trace calls it (GenAI conventions: text_completion, chat)
    add_special_tokens: bool = True  # False for text that holds them already (a rendered chat template)


@dataclass(frozen=True)
class Plan:
    """A request checked and tokenized, its options resolved against the server's defaults."""

    prompt: list[int]
    sampling: SamplingParams
    proposer: str | None  # None = plain decoding
    max_nodes: int  # of the budget (0 = no drafter)
    max_depth: int
    overlap: bool
    policy: str
    restart_depth: int | None
    operation: str


@dataclass(frozen=True)
class Chunk:
    """Tokens a step committed, their text (held back while it could begin a stop string), the step's stats
    (None for the prefill's first token)."""

    token_ids: tuple[int, ...]
    text: str
    step: StepStats | None


@dataclass(frozen=True)
class Final:
    """The end of a request: its result (finish reason, stats) and the text not sent yet."""

    result: GenerationResult
    text: str


class Backend(Protocol):
    """Where a request's engines come from."""

    info: ModelInfo  # the target's vocabulary, context and end tokens
    max_tree_nodes: int  # the verifiers' largest tree: budgets are clamped to it
    draft_timeout: float  # a drafter slower than this per step is failed over (seconds)

    def attempts(self, plan: Plan, deadline: float | None) -> Iterator[Engine]:
        """Engines to try in order; the next is tried only when one fails retryably before its first token."""

    def retryable(self, exc: Exception) -> bool:
        """Whether the failure of an engine that emitted nothing should move the request to the next one."""

    def healthy(self) -> bool:
        """Whether a request could be served now (at least one verifier up)."""

    def register_metrics(self, registry) -> None:
        """Add the backend's own metrics (e.g. an in-process verifier's KV pool) to a Prometheus registry."""


def least_loaded(clients: Sequence, rng: random.Random) -> list:
    """Clients ordered by the sessions they serve now; ties in random order."""
    return sorted(clients, key=lambda c: (c.num_sessions, rng.random()))


class RemoteBackend:
    """Verifier and drafter replicas over gRPC. A request sticks to one verifier (its KV cache), least-loaded
    first, moving to the next only when one is unavailable or full before the first token; its drafter
    candidates are the drafter replicas, least-loaded first, then prompt lookup in this process."""

    def __init__(self, verifiers: Sequence[VerifierClient], drafters: Sequence[DrafterClient],
                 max_tree_nodes: int = 256, draft_timeout: float = 1.0, model: str = "") -> None:
        """``verifiers``: clients whose ``fetch_info`` succeeded; ``max_tree_nodes``: the smallest limit they
        reported; ``model``: the model path they reported (names the model when nothing else does)."""
        self.model = model
        self.verifiers, self.drafters = list(verifiers), list(drafters)
        first = self.verifiers[0].info
        self.info = ModelInfo(first.vocab_size, min(v.info.max_positions for v in self.verifiers),
                              first.eos_token_ids)
        self.max_tree_nodes = max_tree_nodes
        self.draft_timeout = draft_timeout
        self._local = LocalDrafter(make_proposer("prompt_lookup"))  # last resort before plain decoding
        self._rng = random.Random()

    def set_replicas(self, verifiers: Sequence[VerifierClient], drafters: Sequence[DrafterClient]) -> None:
        """Replace the replica sets (a Ray Serve deployment scaled, a replica died); requests in flight keep the
        clients they hold. ``verifiers``: fetched, serving this backend's vocabulary; empty = every request fails
        UNAVAILABLE until one comes back."""
        self.verifiers, self.drafters = list(verifiers), list(drafters)

    def attempts(self, plan: Plan, deadline: float | None) -> Iterator[Engine]:
        base = build_policy(plan.policy, plan.max_nodes, plan.max_depth, self.draft_timeout, plan.restart_depth)
        drafting = plan.proposer is not None and plan.max_nodes > 0
        # a feature-based proposer (Falcon heads): the verifier reports the target's features of the session and
        # the engine forwards them to the drafter (DrafterInfo.feature_proposers)
        features = drafting and any(c.wants_features(plan.proposer) for c in self.drafters)
        for verifier in least_loaded(self.verifiers, self._rng):
            candidates = []
            if drafting:
                candidates = [(f"drafter {c.address}", lambda c=c: c.drafter(plan.proposer, deadline))
                              for c in least_loaded(self.drafters, self._rng)]
                candidates.append(("local prompt_lookup", lambda: self._local))
            policy = load_aware(base, verifier.costs)  # trees sized for this replica's load
            yield Engine(verifier.bind(deadline), candidates, policy, None, overlap=plan.overlap, features=features)

    def retryable(self, exc: Exception) -> bool:
        if isinstance(exc, rpc.UpstreamError) and exc.code in (grpc.StatusCode.UNAVAILABLE,
                                                               grpc.StatusCode.RESOURCE_EXHAUSTED):
            log.warning("%s %s before the first token", exc.service,
                        "full" if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "unavailable")
            return True
        return False

    def healthy(self) -> bool:
        return any(v.healthy() for v in self.verifiers)

    def register_metrics(self, registry) -> None:
        """Nothing to add: the verifiers' and drafters' metrics are served by their own processes."""


class _LoopOutput:
    """An engine core's RequestOutput for a consumer on an asyncio loop: events go into ``queue`` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def event(self, event: StepEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def finish(self, result: GenerationResult, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (result, error))


class GenerationService:
    """Admission, request checks and the worker threads that run engines; one per server process."""

    def __init__(
        self,
        backend: Backend,
        tokenizer,
        model_name: str,
        default_proposer: str | None = DEFAULT_PROPOSER,
        max_concurrent: int = 64,
        max_queued: int = 256,
        overlap: bool = DEFAULT_OVERLAP,
        policy: str = DEFAULT_POLICY,
        restart_depth: int | None = None,
        max_prompt_bytes: int | None = None,
        metrics: ServeMetrics | None = None,
    ) -> None:
        """``max_prompt_bytes``: a text prompt longer than this (UTF-8) is refused before it is tokenized;
        None = PROMPT_BYTES_PER_POSITION per position of the context. ``overlap``, ``policy``,
        ``restart_depth``: defaults for requests that leave them unset."""
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.info = backend.info
        if default_proposer is not None and acceptance_of(default_proposer) != "exact":
            raise ValueError(f"{default_proposer} is lossy: it cannot be the default proposer; requests ask for it by "
                             "name")
        self.default_proposer = default_proposer
        self.overlap, self.policy, self.restart_depth = overlap, policy, restart_depth
        self.max_prompt_bytes = max_prompt_bytes or PROMPT_BYTES_PER_POSITION * self.info.max_positions
        self.metrics = metrics if metrics is not None else ServeMetrics(model_name)
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="engine")
        self.max_requests = max_concurrent + max_queued  # beyond this: Overloaded
        self.num_requests = 0  # admitted and not finished; touched only on the event loop

    # ------------------------------------------------------------- checks
    def plan(self, request: GenerateRequest) -> Plan:
        """The request checked and tokenized, or ValueError. Tokenizing costs time: call it off the event loop
        (``prepare``)."""
        # sizes first: a prompt that cannot fit the context is refused before it costs tokenizing
        max_positions = self.info.max_positions
        if (request.prompt is None) == (request.token_ids is None):
            raise ValueError("give either a text prompt or token ids")
        if request.prompt is not None:
            if not request.prompt:
                raise ValueError("empty prompt")
            size = len(request.prompt)  # characters: a lower bound of the UTF-8 bytes, free to read
            if size > self.max_prompt_bytes or len(request.prompt.encode()) > self.max_prompt_bytes:
                raise ValueError(f"the prompt has over {self.max_prompt_bytes} bytes, more than the model's "
                                 f"context of {max_positions} tokens can hold (--max-prompt-bytes)")
            prompt = list(self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        else:
            if len(request.token_ids) > max_positions:
                raise ValueError(f"the prompt has {len(request.token_ids)} tokens; the model's context is "
                                 f"{max_positions}")
            prompt = [int(t) for t in request.token_ids]
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.info.vocab_size})")
        sampling = request.sampling
        if len(prompt) + sampling.max_new_tokens > max_positions:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                             f"the model's context of {max_positions} positions")
        proposer = request.proposer or self.default_proposer
        if proposer in ("none", "ar"):
            proposer = None
        if proposer is not None and proposer not in proposer_names():
            raise ValueError(f"unknown proposer {proposer!r}; choose from {', '.join(proposer_names())}, none")
        sampling = request_sampling(proposer, sampling)  # a lossy acceptance only for the proposer asked for
        nodes, depth = resolve_budget(proposer, request.max_nodes, request.max_depth, self.backend.max_tree_nodes)
        policy = request.policy or self.policy
        overlap = self.overlap if request.overlap is None else request.overlap
        restart = self.restart_depth if request.restart_depth is None else request.restart_depth
        build_policy(policy, nodes, depth, self.backend.draft_timeout, restart)  # unknown names fail here, early
        return Plan(prompt, sampling, proposer, nodes, depth, overlap, policy, restart, request.operation)

    async def prepare(self, request: GenerateRequest) -> Plan:
        """``plan`` on a thread: a huge prompt must not stall the event loop while it is tokenized."""
        return await asyncio.get_running_loop().run_in_executor(None, self.plan, request)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------- requests
    async def stream(self, plan: Plan, deadline: float | None = None) -> AsyncIterator[Chunk | Final]:
        """The request's Chunks as steps commit, then its Final. ``deadline``: absolute time.monotonic().
        Closing the iterator early (the client went away) stops the engine at its next step, which releases
        the verifier session and the drafter."""
        if self.num_requests >= self.max_requests:
            raise Overloaded(f"{self.num_requests} requests in flight or queued; try again later")
        if getattr(self.backend, "submit", None) is not None:  # an engine core steps it: no thread of its own
            self.num_requests += 1
            try:
                async for item in self._stream_on_core(plan):
                    yield item
            finally:
                self.num_requests -= 1
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        metrics = self.metrics.request()
        context = contextvars.copy_context()  # the caller's trace context (a gRPC or HTTP server span)

        def emit(item: Chunk) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> Final:
            try:
                return context.run(self._work, plan, deadline, cancelled, emit, metrics)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        self.num_requests += 1
        future = loop.run_in_executor(self._executor, work)
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
            yield await future
        finally:
            self.num_requests -= 1
            cancelled.set()  # the client went away, or we are done: the engine stops at its next step
            if not future.done():  # abandoned: its outcome (an abort) needs no one, but is not left unread
                future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _stream_on_core(self, plan: Plan) -> AsyncIterator[Chunk | Final]:
        """A request on an engine core (``backend.submit``): its events arrive on this event loop through
        ``call_soon_threadsafe``; leaving early cancels it. The request span is not made current anywhere (no
        thread runs the request): the core records each step as its child."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        metrics = self.metrics.request()
        span = tracing.start_request_span(plan.operation, self.model_name, plan.sampling, len(plan.prompt))
        text = TextStream(self.decode, plan.sampling.stop)
        result = GenerationResult([], "error", RequestStats(prompt_tokens=len(plan.prompt)))
        cancel, finished = None, False
        metrics.started()
        try:
            # building the request's proposer may open a store: off the event loop
            cancel = await loop.run_in_executor(None, self.backend.submit, plan, _LoopOutput(loop, queue), span)
            while True:
                item = await queue.get()
                if isinstance(item, StepEvent):
                    yield self._chunk(item, text.push(item.tokens, item.text_limit), metrics)
                    continue
                result, error = item
                finished = True
                if error is not None:
                    raise error
                tracing.record_request_result(span, result.finish_reason, result.stats.num_generated,
                                              result.stats.summary())
                yield Final(result, text.flush(result.text_limit))
                return
        except Exception as exc:
            tracing.record_error(span, exc)
            raise
        finally:
            if cancel is not None and not finished:
                cancel()  # the client went away: the core ends the request at its next step
                result = GenerationResult([], "aborted", result.stats)
            metrics.finished(result.finish_reason, len(plan.prompt), result.stats.num_generated)
            span.end()

    def _work(self, plan: Plan, deadline, cancelled: threading.Event, emit: Callable[[Chunk], None],
              metrics) -> Final:
        """Worker thread: run the request under its trace span, feeding the metrics."""
        metrics.started()
        result = GenerationResult([], "error", RequestStats(prompt_tokens=len(plan.prompt)))
        try:
            with tracing.request_span(plan.operation, self.model_name, plan.sampling, len(plan.prompt)) as span:
                final = self._run(plan, deadline, cancelled, emit, metrics)
                result = final.result
                tracing.record_request_result(span, result.finish_reason, result.stats.num_generated,
                                              result.stats.summary())
            return final
        finally:
            metrics.finished(result.finish_reason, len(plan.prompt), result.stats.num_generated)

    def _run(self, plan: Plan, deadline, cancelled: threading.Event, emit: Callable[[Chunk], None],
             metrics) -> Final:
        """Run the engines the backend offers until one serves the request (see Backend.attempts)."""
        error: Exception | None = None
        for engine in self.backend.attempts(plan, deadline):
            if cancelled.is_set():  # gone while queued: do not even prefill
                return Final(GenerationResult([], "aborted", RequestStats(prompt_tokens=len(plan.prompt))), "")
            engine.decode = self.decode  # stop strings are matched on text
            result = GenerationResult([], "", RequestStats())
            text = TextStream(self.decode, plan.sampling.stop)
            emitted = False
            try:
                with contextlib.closing(engine.stream(plan.prompt, plan.sampling, result)) as events:
                    for event in events:
                        emitted = True
                        emit(self._chunk(event, text.push(event.tokens, result.text_limit), metrics))
                        if cancelled.is_set():
                            break  # closing the stream releases the verifier session and the drafter
                return Final(result, text.flush(result.text_limit))
            except Exception as exc:
                if emitted or not self.backend.retryable(exc):
                    raise
                error = exc
        if error is not None:
            raise error
        raise rpc.UpstreamError("serve", grpc.StatusCode.UNAVAILABLE, "no verifier to run the request on")

    @staticmethod
    def _chunk(event: StepEvent, text: str, metrics) -> Chunk:
        """The client's chunk of a step's event; the step and its tokens counted in the request's metrics."""
        if event.step is not None:
            metrics.step(event.step)
        metrics.emitted(len(event.tokens))
        return Chunk(event.tokens, text, event.step)

    def healthy(self) -> bool:
        return self.backend.healthy()
