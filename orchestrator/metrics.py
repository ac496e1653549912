"""Prometheus metrics of the orchestrator (`specmesh serve`, the embedded server): requests and speculation.

``ServeMetrics`` holds the metrics of one process; the request service calls ``request()`` when a
request arrives and drives the ``RequestMetrics`` it returns through the request's life:

    metrics = serve_metrics.request()          # counted as waiting (queue depth)
    metrics.started()                          # a worker picked it up: waiting -> running
    metrics.emitted(n)                         # n tokens went to the client now (TTFT, inter-token latency)
    metrics.step(step_stats)                   # one speculative step (drafts, accepted tokens, failovers)
    metrics.finished(reason, prompt, generated, stats)  # once; later calls do nothing (call it from a finally)

Names follow vLLM's (``specmesh_`` for ``vllm:``); every metric carries vLLM's ``model_name`` label.
Labelled children exist from the start at 0, as vLLM's ``finished_reason`` ones do, so ``increase()`` and
error-ratio alerts see a series before its first event: every finish reason, every registered proposer as
``source``, every ``position`` a proposer's default budget reaches (deeper ones appear when first used).
Inter-token latency is per token: a chunk of n tokens arriving a gap g after the previous chunk is n
samples of g / n (a speculative step commits several tokens at once; per-chunk samples would hide
that). The first chunk with tokens gives time to first token, measured from ``request()`` (queueing
included, as vLLM measures from arrival); its other tokens, if any, give no inter-token sample.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drafter_service.proposer import proposer_names, proposer_spec
from orchestrator.stats import RequestStats, StepStats
from specmesh.metrics import PREFIX, new_registry

# vLLM's buckets, extended downwards: a speculative step can commit a token every few milliseconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
ACCEPTANCE_RATE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
REQUEST_TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
MAX_SOURCES = 32  # distinct `source` labels (proposer names) before the rest count as "other"
FINISHED_REASONS = ("stop", "length", "error", "aborted")  # the stop checker's, and the two failures


def default_positions() -> int:
    """Draft positions a default budget reaches: the deepest registered proposer's default depth."""
    return max((proposer_spec(name).max_depth for name in proposer_names()), default=0)


class ServeMetrics:
    """The orchestrator's metrics in ``registry`` (default: a new one of its own, ``.registry``)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, num_positions: int | None = None) -> None:
        """``clock``: seconds, for the latencies (tests pass a fake one). ``num_positions``: the per-position
        children made at 0 up front (default: ``default_positions()``)."""
        self.registry = registry = new_registry(registry)
        self.model_name = model_name
        self.clock = clock
        model = ["model_name"]

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, [*model, *labels], registry=registry)

        # requests (children bound to this model: labels() costs a lock and a lookup)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests a worker is generating for.", model,
                             registry=registry).labels(model_name)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a worker (queue depth).", model,
                             registry=registry).labels(model_name)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token going out.", model,
                              registry=registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Seconds between tokens after the first, per token (a chunk of n tokens a gap g after "
                             "the previous one counts n times g/n).", model,
                             registry=registry, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Seconds from a request's arrival to its end.", model,
                             registry=registry, buckets=E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated by finished requests.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason ('stop', 'length', ...; "
                                "'error' and 'aborted' for failures).", "finished_reason")
        # speculative decoding (vLLM's names), and what vLLM has no name for
        self.num_drafts = counter("spec_decode_num_drafts", "Steps that verified a draft tree.").labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                        "Draft tokens verified (tree nodes).").labels(model_name)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted (bonus tokens not included).").labels(model_name)
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Steps that accepted a draft token at this depth (0 = first).", "position")
        self._draft_tokens_per_source = counter("spec_decode_num_draft_tokens_per_source",
                                                "Draft tokens verified, by the proposer that drafted them.", "source")
        self._accepted_per_source = counter("spec_decode_num_accepted_tokens_per_source",
                                            "Draft tokens accepted, by the proposer that drafted them.", "source")
        self.failovers = counter("spec_decode_num_drafter_failovers",
                                 "Steps in which a drafter failed (raised, timed out or broke the contract) and the "
                                 "next candidate took over.").labels(model_name)
        self.tokens_per_step = Histogram(PREFIX + "spec_decode_tokens_per_step",
                                         "Tokens committed per verification step (accepted + bonus); mean = tau.",
                                         model, registry=registry, buckets=TOKENS_PER_STEP_BUCKETS).labels(model_name)
        # per request that drafted (a plain request has no acceptance to report)
        self.request_acceptance_rate = Histogram(
            PREFIX + "request_acceptance_rate",
            "Per finished request that drafted: draft tokens accepted / draft tokens verified.", model,
            registry=registry, buckets=ACCEPTANCE_RATE_BUCKETS).labels(model_name)
        self.request_tau = Histogram(
            PREFIX + "request_tau", "Per finished request that drafted: tokens committed per verification step.",
            model, registry=registry, buckets=REQUEST_TAU_BUCKETS).labels(model_name)
        self._positions: list = []  # children of _accepted_per_pos, by position
        self._sources: dict[tuple[bool, str], object] = {}  # children of the per-source counters
        self._source_names: set[str] = set()
        self._lock = threading.Lock()
        # every known label value at 0 now, not at its first event
        for reason in FINISHED_REASONS:
            self.success(reason)
        for name in proposer_names():
            self.per_source(False, name)
            self.per_source(True, name)
        for position in range(default_positions() if num_positions is None else num_positions):
            self.accepted_at(position)

    def request(self) -> RequestMetrics:
        """A request arrived: it waits for a worker until ``started()``."""
        return RequestMetrics(self)

    # ------------------------------------------------------------ internals
    def success(self, finished_reason: str):
        return self._success.labels(self.model_name, finished_reason)

    def accepted_at(self, position: int):
        """The per-position counter's child of ``position``."""
        if position >= len(self._positions):
            with self._lock:
                while len(self._positions) <= position:
                    self._positions.append(self._accepted_per_pos.labels(self.model_name, str(len(self._positions))))
        return self._positions[position]

    def per_source(self, accepted: bool, source: str):
        """The per-source counter's child of ``source``; past MAX_SOURCES names, 'other' (source names come
        from drafters: a faulty one must not grow the registry without bound)."""
        child = self._sources.get((accepted, source))
        if child is None:
            family = self._accepted_per_source if accepted else self._draft_tokens_per_source
            with self._lock:
                if source not in self._source_names and len(self._source_names) >= MAX_SOURCES:
                    return family.labels(self.model_name, "other")
                self._source_names.add(source)
                child = self._sources[accepted, source] = family.labels(self.model_name, source)
        return child


_WAITING, _RUNNING, _DONE = range(3)


class RequestMetrics:
    """One request's part of ``ServeMetrics`` (see the module doc). Thread-safe."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self._m = metrics
        self._arrival = self._last = metrics.clock()
        self._first_out = False
        self._state = _WAITING
        self._lock = threading.Lock()
        metrics.waiting.inc()

    def started(self) -> None:
        """A worker picked the request up (waiting -> running); once."""
        with self._lock:
            if self._state != _WAITING:
                return
            self._state = _RUNNING
        self._m.waiting.dec()
        self._m.running.inc()

    def emitted(self, num_tokens: int) -> None:
        """A chunk of ``num_tokens`` tokens went to the client now."""
        if num_tokens <= 0:
            return
        now = self._m.clock()
        with self._lock:
            gap, self._last = now - self._last, now
            first, self._first_out = not self._first_out, True
        if first:
            self._m.ttft.observe(now - self._arrival)
            return
        per_token = gap / num_tokens
        for _ in range(num_tokens):
            self._m.itl.observe(per_token)

    def step(self, step: StepStats) -> None:
        """One verification step of the request."""
        m = self._m
        if step.num_proposed > 0:
            m.num_drafts.inc()
            m.num_draft_tokens.inc(step.num_proposed)
        if step.num_accepted > 0:
            m.num_accepted_tokens.inc(step.num_accepted)
            for position in range(step.num_accepted):
                m.accepted_at(position).inc()
        for accepted, sources in ((False, step.proposed_sources), (True, step.accepted_sources)):
            for source, count in Tally(sources).items():
                m.per_source(accepted, source).inc(count)
        if step.draft_error:
            m.failovers.inc()
        m.tokens_per_step.observe(step.num_accepted + 1)

    def finished(self, finish_reason: str, prompt_tokens: int, generated_tokens: int,
                 stats: RequestStats | None = None) -> None:
        """The request ended (``finish_reason``: the stop checker's, or 'error' / 'aborted'; ``stats``: its steps,
        for the per-request acceptance rate and tau when it drafted); only the first call counts."""
        with self._lock:
            state, self._state = self._state, _DONE
        if state == _DONE:
            return
        m = self._m
        (m.waiting if state == _WAITING else m.running).dec()
        m.e2e.observe(m.clock() - self._arrival)
        m.prompt_tokens.inc(max(0, prompt_tokens))
        m.generation_tokens.inc(max(0, generated_tokens))
        m.success(finish_reason or "aborted").inc()
        if stats is not None and any(s.num_proposed for s in stats.steps):
            m.request_acceptance_rate.observe(stats.acceptance_rate)
            m.request_tau.observe(stats.tau)
