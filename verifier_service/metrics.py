"""Prometheus metrics of verifiers (`specmesh verifier`, and the embedded stack's shared verifiers).

Read at scrape time, never pushed from the loop: a custom collector asks a callable for the
process's current schedulers (a replica's ``StepLoop``; the embedded stack's engine core's ``Scheduler``)
and sums their state (sessions, waiting admissions, KV blocks) and their ``BatchStats``, which
the loop keeps anyway; its per-step histograms are ``specmesh.metrics.Buckets`` filled once per
step. Names cannot clash with the orchestrator's (``orchestrator/metrics.py``), so an embedded
server may put both in one registry. Every family carries the ``model_name`` label, as the orchestrator's do.
KV usage counts the blocks holding tokens; the blocks sessions have taken (a step takes those its rows
write before its forward) are a gauge of their own, and so are the sessions preempted for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from specmesh.metrics import PREFIX, histogram_family, new_registry
from verifier_service.scheduler import BatchStats, Scheduler
from verifier_service.step_loop import StepLoop

LABELS = ["model_name"]
EMPTY = BatchStats()  # what a verifier's histograms hold before its first step

GAUGES = (
    ("verifier_num_sessions", "Sessions admitted (holding KV blocks), prefilling or decoding."),
    ("verifier_num_waiting", "Prefills waiting for KV blocks (admission queue depth)."),
    ("kv_cache_usage_perc", "Fraction of the KV pool's blocks holding tokens (0-1)."),
    ("verifier_kv_blocks", "KV blocks in the pool."),
    ("verifier_kv_blocks_used", "KV blocks holding tokens."),
    ("verifier_kv_blocks_reserved", "KV blocks taken by sessions (their tokens', and a step's rows until it ends)."),
    ("verifier_num_preempted", "Sessions preempted for other sessions' KV blocks, holding none until they resume."),
    ("verifier_kv_capacity_tokens", "Tokens the KV pool holds (blocks x block size)."),
)
# (name, documentation, BatchStats field)
COUNTERS = (
    ("verifier_steps", "Batched forwards run by the verifier's scheduler.", "steps"),
    ("verifier_verify_calls", "Verifications served (Verify calls and VerifyBatch items).", "verified"),
    ("verifier_verify_rows", "Rows of the Verify calls: the pending token and the tree's nodes of each.",
     "verify_rows"),
    ("verifier_prefill_calls", "Prefills finished (one per session).", "prefills"),
    ("verifier_prefill_chunks", "Prompt chunks run (a long prompt runs in several steps).", "prefill_chunks"),
    ("verifier_prefill_tokens", "Prompt tokens run (a resumed session's recomputed tokens included).",
     "prefill_tokens"),
    ("num_preemptions", "Sessions preempted: their KV blocks given back for a step's rows, recomputed on resuming.",
     "preemptions"),
)
# (name, documentation, BlockAllocator counter): the prefix cache, in tokens (vLLM's)
POOL_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (a resumed session's included).", "queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache: their KV reused, not computed.", "hits"),
)
HISTOGRAMS = (
    ("verifier_batch_sessions", "Sessions in one forward (Verify calls + prompt chunks).", "batch_sessions"),
    ("verifier_batch_rows", "Rows in one forward (tree rows + prompt chunk tokens).", "batch_rows"),
    ("verifier_step_seconds", "Seconds of one batched step (forward, acceptance, host copy).", "step_seconds"),
)


def running_waiting(loop) -> tuple[int, int]:
    """(running, waiting) sessions of a step loop, or of an engine core over one: unlocked reads, a racing pair
    clamped."""
    waiting = loop.num_waiting
    return max(0, loop.num_sessions - waiting), waiting


def pool_load(loops: Iterable[StepLoop | Scheduler]) -> dict:
    """Sessions and KV blocks of step loops together: running, waiting, preempted, kv_blocks, kv_blocks_used
    (holding tokens), kv_blocks_reserved (taken by sessions), kv_usage (used / blocks)."""
    running = waiting = preempted = blocks = used = reserved = 0
    for loop in loops:
        num_running, num_waiting = running_waiting(loop)
        running += num_running
        waiting += num_waiting
        preempted += getattr(loop, "num_preempted", 0)  # an engine core over a replica: the replica's own
        blocks += loop.verifier.allocator.num_blocks
        used += loop.verifier.num_blocks_filled
        reserved += loop.verifier.allocator.num_used
    return {"running": running, "waiting": waiting, "preempted": preempted, "kv_blocks": blocks, "kv_blocks_used": used,
            "kv_blocks_reserved": reserved, "kv_usage": used / blocks if blocks else 0.0}


class VerifierMetrics:
    """Metrics of the verifiers ``verifiers()`` returns at each scrape, registered in ``registry`` (default: a
    new one, ``.registry``), labelled ``model_name`` (the served model, as ``serve`` names it). ``verifiers``
    must be cheap and thread-safe (it runs on the HTTP thread): e.g. ``lambda: [loop]`` or
    ``lambda: [core.scheduler for core in stack.shared_verifiers()]``."""

    def __init__(self, verifiers: Callable[[], Iterable[StepLoop | Scheduler]],
                 registry: CollectorRegistry | None = None, *, model_name: str) -> None:
        self.verifiers = verifiers
        self.model_name = model_name
        self.registry = new_registry(registry)
        self.registry.register(self)

    def describe(self):
        """The families, without values: the registry refuses a name another collector already has."""
        yield from (GaugeMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc in GAUGES)
        yield from (CounterMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc, _ in COUNTERS)
        yield from (CounterMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc, _ in POOL_COUNTERS)
        yield from (HistogramMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc, _ in HISTOGRAMS)

    def collect(self):
        verifiers = list(self.verifiers())
        load = pool_load(verifiers)
        labels = [self.model_name]
        values = (load["running"], load["waiting"], load["kv_usage"], load["kv_blocks"], load["kv_blocks_used"],
                  load["kv_blocks_reserved"], load["preempted"],
                  sum(v.verifier.allocator.num_blocks * v.verifier.allocator.block_size for v in verifiers))
        for (name, doc), value in zip(GAUGES, values, strict=True):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, value)
            yield family
        for name, doc, attr in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, sum(getattr(v.stats, attr) for v in verifiers))
            yield family
        for name, doc, attr in POOL_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, sum(getattr(v.verifier.allocator, attr) for v in verifiers))
            yield family
        for name, doc, attr in HISTOGRAMS:
            # with no verifier yet (the embedded stack makes them lazily), a histogram of zeros over the bounds
            # every verifier uses: the series exist from the first scrape
            histograms = [getattr(v.stats, attr) for v in verifiers] or [getattr(EMPTY, attr)]
            yield histogram_family(PREFIX + name, doc, histograms, LABELS, labels)
