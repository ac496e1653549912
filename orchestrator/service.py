"""The request path every front end shares: check a request, admit it, submit it to an engine core, stream
its steps.

The gRPC ``Generate`` service (orchestrator/server.py) and the OpenAI-compatible HTTP API
(orchestrator/http_api.py) are shells over ``GenerationService``: each turns its request into a
``GenerateRequest``, awaits ``prepare`` (checks and tokenizes), iterates ``stream`` and maps the
exceptions below to its own status codes:

    ValueError                  bad input                       INVALID_ARGUMENT / 400
    Overloaded                  too many requests in flight     RESOURCE_EXHAUSTED / 429
    CapacityError               no KV room (embedded verifier)  RESOURCE_EXHAUSTED / 429
    rpc.UpstreamError           a verifier failed, or the       its code (UNAVAILABLE / 503, ...)
                                request's deadline passed
    UnknownSessionError         the verifier lost the session   UNAVAILABLE / 503

Where the requests run is a ``Backend``: verifier and drafter replicas over gRPC (``RemoteBackend``,
`specmesh serve --verifier ...`: an engine core per replica, orchestrator/remote_loop.py) or models in this
process (``orchestrator.embedded.EmbeddedBackend``, `specmesh serve --embedded`). Either way a request is data
held by an engine core (orchestrator/core.py), whose one thread steps it with every other: no thread per
request. Its events reach the service's event loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import DEFAULT_PROPOSER, make_proposer, proposer_names
from drafter_service.remote import DrafterClient
from orchestrator.acceptance import acceptance_of, request_sampling
from orchestrator.core import EngineCore
from orchestrator.engine import GenerationResult, StepEvent
from orchestrator.metrics import ServeMetrics
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, build_policy, load_aware, resolve_budget
from orchestrator.requests import Method, RequestOutput
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import TextStream
from specmesh import rpc, tracing
from specmesh.contract import ModelInfo, TokenLogprobs
from specmesh.sampling import SamplingParams
from specmesh.tree import MAX_TREE_NODES
from verifier_service.metrics import running_waiting
from verifier_service.remote import VerifierClient

log = logging.getLogger("specmesh.serve")
request_log = logging.getLogger("specmesh.requests")  # one line per finished request (serve --disable-log-requests)

# a token of a byte-level BPE covers a few bytes on average (up to ~16 for long code identifiers): a text
# prompt of more bytes than this per context position cannot fit, whatever it says
PROMPT_BYTES_PER_POSITION = 32


def request_id_of(exc: BaseException) -> str | None:
    """The id of the request ``exc`` ended (its log line's ``id``), when ``GenerationService.stream`` raised it."""
    return getattr(exc, "request_id", None)


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
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asks


@dataclass(frozen=True)
class Final:
    """The end of a request: its result (finish reason, stats) and the text not sent yet."""

    result: GenerationResult
    text: str


class Backend(Protocol):
    """Where requests run: engine cores, in this process or over gRPC replicas."""

    info: ModelInfo  # the target's vocabulary, context and end tokens
    max_tree_nodes: int  # the verifiers' largest tree: budgets are clamped to it
    draft_timeout: float  # a drafter slower than this per step is failed over (seconds)

    def submit(self, plan: Plan, output: RequestOutput, trace, deadline: float | None, tried: set[str],
               decode: Callable[[list[int]], str]) -> Callable[[], None]:
        """Queue the request on an engine core (its events go to ``output``, on the core's thread; ``trace``: its
        span; ``deadline``: absolute time.monotonic() bounding its drafter streams); returns its cancel.
        ``tried``: the verifiers tried already for it (the one chosen is added); ``decode``: token ids -> text,
        for stop strings. ValueError / CapacityError / UpstreamError for a request it cannot take."""

    def retryable(self, exc: Exception) -> bool:
        """Whether a request that failed with ``exc`` before its first token should be submitted again (to a
        verifier it has not tried)."""

    def healthy(self) -> bool:
        """Whether a request could be served now (at least one verifier up)."""

    def load(self) -> dict:
        """What a router reads to place requests (``/load``): ``running`` and ``waiting`` requests of the engine
        cores, the KV pool's ``kv_blocks`` / ``kv_blocks_used`` / ``kv_usage`` where the pool is in this
        process, replica counts where it is not (never an address: /load is open to anyone)."""

    def register_metrics(self, registry, model_name: str) -> None:
        """Add the backend's own metrics (e.g. an in-process verifier's KV pool) to a Prometheus registry,
        labelled ``model_name`` as the orchestrator's."""


def least_loaded(clients: Sequence, rng: random.Random) -> list:
    """Clients ordered by the sessions they serve now; ties in random order."""
    return sorted(clients, key=lambda c: (c.num_sessions, rng.random()))


class RemoteBackend:
    """Verifier and drafter replicas over gRPC, an engine core per verifier replica (orchestrator/remote_loop.py).
    A request sticks to one verifier (its KV cache), least-loaded first, moving to the next only when one is
    unavailable or full before the first token; its drafter candidates are the drafter replicas, least-loaded
    first, then prompt lookup in this process."""

    def __init__(self, verifiers: Sequence[VerifierClient], drafters: Sequence[DrafterClient],
                 max_tree_nodes: int = MAX_TREE_NODES, draft_timeout: float = 1.0, model: str = "") -> None:
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
        self._lock = threading.Lock()
        self._cores: dict[VerifierClient, EngineCore] = {}  # created on a replica's first request

    def set_replicas(self, verifiers: Sequence[VerifierClient], drafters: Sequence[DrafterClient]) -> None:
        """Replace the replica sets (a Ray Serve deployment scaled, a replica died); requests in flight keep the
        replicas they run on. ``verifiers``: fetched, serving this backend's vocabulary; empty = every request
        fails UNAVAILABLE until one comes back. The engine core of a replica that left stops once idle."""
        self.verifiers, self.drafters = list(verifiers), list(drafters)
        with self._lock:
            gone = [c for c in self._cores if c not in self.verifiers and self._cores[c].num_sessions == 0]
            cores = [self._cores.pop(c) for c in gone]
        for core in cores:
            core.close()

    def submit(self, plan: Plan, output: RequestOutput, trace, deadline: float | None, tried: set[str],
               decode: Callable[[list[int]], str]) -> Callable[[], None]:
        verifiers = [v for v in least_loaded(self.verifiers, self._rng) if v.address not in tried]
        if not verifiers:
            raise rpc.UpstreamError("serve", grpc.StatusCode.UNAVAILABLE, "no verifier to run the request on")
        verifier = verifiers[0]
        tried.add(verifier.address)
        core = self._core(verifier, decode)
        request_id = core.submit(plan.prompt, plan.sampling, self._method(plan, core, deadline), output,
                                 trace=trace)
        return lambda: core.cancel(request_id)

    def _core(self, verifier: VerifierClient, decode: Callable[[list[int]], str]) -> EngineCore:
        with self._lock:
            core = self._cores.get(verifier)
            if core is None:
                core = self._cores[verifier] = EngineCore(verifier, decode, name=f"core-{verifier.address}")
            return core

    def _method(self, plan: Plan, core: EngineCore, deadline: float | None) -> Method:
        """The request's drafters (the replicas, then prompt lookup here), its policy sized for the verifier's
        load; their calls run on the drafting pool."""
        base = build_policy(plan.policy, plan.max_nodes, plan.max_depth, self.draft_timeout, plan.restart_depth)
        drafting = plan.proposer is not None and plan.max_nodes > 0
        # a feature-based proposer (Falcon heads): the verifier reports the target's features of the session and
        # the core forwards them to the drafter (DrafterInfo.feature_proposers)
        features = drafting and any(c.wants_features(plan.proposer) for c in self.drafters)
        candidates = []
        if drafting:
            candidates = [(f"drafter {c.address}", lambda c=c: c.drafter(plan.proposer, deadline))
                          for c in least_loaded(self.drafters, self._rng)]
            candidates.append(("local prompt_lookup", lambda: self._local))
        # trees sized for this replica's load, with the acceptance of the method's requests on it
        method = (plan.proposer, plan.max_nodes, plan.max_depth, plan.policy, plan.restart_depth)
        policy = load_aware(base, core.costs, pooled=core.method_steps(method))
        return Method(candidates, policy, features, overlap=plan.overlap, background=True)

    def retryable(self, exc: Exception) -> bool:
        if isinstance(exc, rpc.UpstreamError) and exc.code in (grpc.StatusCode.UNAVAILABLE,
                                                               grpc.StatusCode.RESOURCE_EXHAUSTED):
            log.warning("%s %s before the first token", exc.service,
                        "full" if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "unavailable")
            return True
        return False

    def healthy(self) -> bool:
        return any(v.healthy() for v in self.verifiers)

    def load(self) -> dict:
        """Requests of the engine cores (one per verifier replica) and how many replicas there are and answer:
        counts only, never an address (the replicas' KV pools are on their own /metrics)."""
        with self._lock:
            cores = dict(self._cores)
        running = waiting = healthy = 0
        for verifier in self.verifiers:
            r, w = running_waiting(cores[verifier]) if verifier in cores else (0, 0)
            running, waiting, healthy = running + r, waiting + w, healthy + verifier.healthy()
        return {"running": running, "waiting": waiting, "verifiers": len(self.verifiers),
                "verifiers_healthy": healthy}

    def register_metrics(self, registry, model_name: str) -> None:
        """Nothing to add: the verifiers' and drafters' metrics are served by their own processes."""


class _LoopOutput:
    """An engine core's RequestOutput for a consumer on an asyncio loop: events go into ``queue`` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def event(self, event: StepEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def finish(self, result: GenerationResult, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (result, error))


def request_line(request_id: str, plan: Plan, result: GenerationResult, started: float, first_token: float | None,
                 failure: BaseException | None = None) -> str:
    """A finished request as one logfmt line (``key=value``; text values quoted): its id, finish reason (or the
    error that ended it), token counts, sampling parameters, proposer, tau, time to first token and duration.
    ``started``/``first_token``: time.monotonic() at admission and at its first streamed token (None: none)."""
    sampling, stats = plan.sampling, result.stats
    now = time.monotonic()
    fields: dict[str, object] = {
        "id": request_id, "op": plan.operation,
        "finish": "error" if failure is not None else result.finish_reason,
        "prompt_tokens": len(plan.prompt), "output_tokens": stats.num_generated,
        "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "seed": sampling.seed, "stop": len(sampling.stop),
        "proposer": plan.proposer or "none", "max_nodes": plan.max_nodes, "max_depth": plan.max_depth,
        "tau": round(stats.tau, 2) if stats.num_steps else None,
        "ttft_ms": round((first_token - started) * 1e3, 1) if first_token is not None else None,
        "duration_ms": round((now - started) * 1e3, 1),
    }
    if failure is not None:
        fields["error"] = f"{type(failure).__name__}: {failure}"
    return " ".join(f"{key}={_logfmt(value)}" for key, value in fields.items() if value is not None)


def _logfmt(value: object) -> str:
    text = str(value)
    if isinstance(value, str) and (not text or any(c in text for c in ' "=\\') or not text.isprintable()):
        return json.dumps(text)  # quoted, escaped, one line
    return text


class GenerationService:
    """Admission, request checks and the requests' streams; one per server process."""

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
        log_requests: bool = True,
        default_budget: tuple[int | None, int | None] = (None, None),
    ) -> None:
        """``max_prompt_bytes``: a text prompt longer than this (UTF-8) is refused before it is tokenized;
        None = PROMPT_BYTES_PER_POSITION per position of the context. ``overlap``, ``policy``,
        ``restart_depth``: defaults for requests that leave them unset. ``log_requests``: one INFO line per
        finished request on the ``specmesh.requests`` logger (``request_line``). ``default_budget``: (max_nodes,
        max_depth) of requests on the default proposer that leave them unset (None: the proposer's own)."""
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.log_requests = log_requests
        self.info = backend.info
        if default_proposer is not None and acceptance_of(default_proposer) != "exact":
            raise ValueError(f"{default_proposer} is lossy: it cannot be the default proposer; requests ask for it by "
                             "name")
        self.default_proposer = default_proposer
        self.default_budget = default_budget
        self.overlap, self.policy, self.restart_depth = overlap, policy, restart_depth
        self.max_prompt_bytes = max_prompt_bytes or PROMPT_BYTES_PER_POSITION * self.info.max_positions
        self.metrics = metrics if metrics is not None else ServeMetrics(model_name)
        self.max_requests = max_concurrent + max_queued  # beyond this: Overloaded
        self.num_requests = 0  # admitted and not finished; touched only on the event loop

    def load(self) -> dict:
        """The backend's load (``Backend.load``) with this server's requests admitted and not finished
        (``requests``) and their limit, --max-concurrent plus --max-queued (``max_requests``)."""
        return {"requests": self.num_requests, "max_requests": self.max_requests, **self.backend.load()}

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
        asked_nodes, asked_depth = request.max_nodes, request.max_depth
        if not request.proposer:  # the server's default proposer: its budget too, where the request sets none
            asked_nodes = self.default_budget[0] if asked_nodes is None else asked_nodes
            asked_depth = self.default_budget[1] if asked_depth is None else asked_depth
        nodes, depth = resolve_budget(proposer, asked_nodes, asked_depth, self.backend.max_tree_nodes)
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
    async def stream(self, plan: Plan, deadline: float | None = None,
                     request_id: str | None = None) -> AsyncIterator[Chunk | Final]:
        """The request's Chunks as steps commit, then its Final. ``deadline``: absolute time.monotonic(); past
        it the request ends with DEADLINE_EXCEEDED. ``request_id``: the id its client sees (the OpenAI API's
        ``cmpl-…``; None: a ``gen-…`` id of its own), in its log line and as its span's ``gen_ai.response.id``.
        Closing the iterator early (the client went away) cancels it: the core ends it at its next step, which
        releases the verifier session and the drafter. A request that fails retryably before its first token (a
        replica down or full) is submitted again, to a verifier it has not tried. The request span is not made
        current anywhere (no thread runs the request): the core records each step as its child."""
        if self.num_requests >= self.max_requests:
            raise Overloaded(f"{self.num_requests} requests in flight or queued; try again later")
        request_id = request_id or f"gen-{uuid.uuid4().hex}"
        started, first_token = time.monotonic(), None
        loop = asyncio.get_running_loop()
        metrics = self.metrics.request()
        span = tracing.start_request_span(plan.operation, self.model_name, plan.sampling, len(plan.prompt))
        span.set_attributes({"gen_ai.response.id": request_id, "specmesh.proposer": plan.proposer or "none"})
        text = TextStream(self.decode, plan.sampling.stop)
        result = GenerationResult([], "error", RequestStats(prompt_tokens=len(plan.prompt)))
        tried: set[str] = set()
        cancel, finished, emitted, retried, failure = None, False, False, None, None
        self.num_requests += 1  # the finally below gives it back
        metrics.started()
        try:
            while not finished:
                queue: asyncio.Queue = asyncio.Queue()
                output = _LoopOutput(loop, queue)
                # building the request's proposer may open a store or ask a drafter: off the event loop
                try:
                    cancel = await loop.run_in_executor(None, self.backend.submit, plan, output, span, deadline,
                                                        tried, self.decode)
                except rpc.UpstreamError:
                    if retried is not None:  # no verifier left to try: the last one's failure says why
                        raise retried from None
                    raise
                while True:
                    item = await self._next(queue, deadline)
                    if isinstance(item, StepEvent):
                        emitted = True
                        first_token = first_token or time.monotonic()
                        yield self._chunk(item, text.push(item.tokens, item.text_limit), metrics)
                        continue
                    result, error = item
                    cancel = None  # ended: nothing to cancel
                    if error is not None:
                        if not emitted and self.backend.retryable(error):
                            retried = error
                            break  # the next verifier
                        raise error
                    finished = True
                    tracing.record_request_result(span, result.finish_reason, result.stats.num_generated,
                                                  result.stats.summary())
                    yield Final(result, text.flush(result.text_limit))
                    break
        except Exception as exc:
            tracing.record_error(span, exc)
            failure = exc
            exc.request_id = request_id  # what a front end tells its client instead of internals (request_id_of)
            raise
        finally:
            self.num_requests -= 1
            if cancel is not None:
                cancel()  # the client went away, or the deadline passed: the core ends it at its next step
                result = GenerationResult([], "aborted", result.stats)
            metrics.finished(result.finish_reason, len(plan.prompt), result.stats.num_generated, result.stats)
            span.end()
            if self.log_requests:
                request_log.info("%s", request_line(request_id, plan, result, started, first_token, failure))

    @staticmethod
    async def _next(queue: asyncio.Queue, deadline: float | None):
        """The request's next event, or UpstreamError(DEADLINE_EXCEEDED) once ``deadline`` passed."""
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            raise rpc.UpstreamError("serve", grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the request's deadline passed") from None

    @staticmethod
    def _chunk(event: StepEvent, text: str, metrics) -> Chunk:
        """The client's chunk of a step's event; the step and its tokens counted in the request's metrics."""
        if event.step is not None:
            metrics.step(event.step)
        metrics.emitted(len(event.tokens))
        return Chunk(event.tokens, text, event.step, event.logprobs)

    def healthy(self) -> bool:
        return self.backend.healthy()
