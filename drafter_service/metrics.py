"""Prometheus metrics of a drafter server (`specmesh drafter`), by proposer.

The servicer calls ``proposed`` once per Propose it answered; open sessions are read at scrape time
from ``sessions()`` (proposer -> sessions), so opening and closing sessions costs nothing here. Every
family carries ``model_name`` (the served model the drafter drafts for, as ``serve`` names it) and
``proposer``; the children of the proposers served exist at 0 from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.metrics import COUNT_BUCKETS, PREFIX, SECONDS_BUCKETS, new_registry

LABELS = ["model_name", "proposer"]


class DrafterMetrics:
    """A drafter's metrics in ``registry`` (default: a new one, ``.registry``), labelled ``model_name``.
    ``sessions``: returns the open sessions per proposer, called on the HTTP thread at each scrape (None: no
    sessions gauge). ``proposers``: the proposers served, whose series exist at 0 before their first Propose."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 sessions: Callable[[], Mapping[str, int]] | None = None, *, model_name: str,
                 proposers: Iterable[str] = (), draft_kv: Any = None) -> None:
        self.registry = registry = new_registry(registry)
        self.model_name = model_name
        label = LABELS
        self.proposals = Counter(PREFIX + "drafter_proposals", "Proposals drafted (Proposes with a non-zero budget).",
                                 label, registry=registry)
        self.seconds = Histogram(PREFIX + "drafter_proposal_seconds",
                                 "Seconds from a Propose's arrival to its tree (queueing on the model thread "
                                 "included).", label, registry=registry, buckets=SECONDS_BUCKETS)
        self.nodes = Counter(PREFIX + "drafter_proposed_nodes", "Tree nodes proposed.", label, registry=registry)
        self.tree_nodes = Histogram(PREFIX + "drafter_tree_nodes", "Nodes of one proposed tree.", label,
                                    registry=registry, buckets=(0, *COUNT_BUCKETS))
        self.syncs = Counter(PREFIX + "drafter_context_syncs",
                             "Proposes with a zero budget: context updates only (the orchestrator's last call "
                             "before closing a session).", label, registry=registry)
        self.feedback = Counter(PREFIX + "drafter_feedback_items",
                                "Verifications' feedback received with Proposes (one per verification: the "
                                "target's top-k rows, Jacobi n-grams).", label, registry=registry)
        self._children: dict[str, tuple] = {}
        for proposer in proposers:
            self._proposer(proposer)
        if sessions is not None:
            registry.register(_SessionsCollector(sessions, model_name))
        registry.register(_DraftKVCollector(draft_kv, model_name))

    def _proposer(self, proposer: str) -> tuple:
        """The children of ``proposer`` (made on first use: labels() costs a lock and a lookup)."""
        children = self._children.get(proposer)
        if children is None:
            children = self._children[proposer] = tuple(
                m.labels(self.model_name, proposer)
                for m in (self.proposals, self.seconds, self.nodes, self.tree_nodes, self.syncs, self.feedback))
        return children

    def proposed(self, proposer: str, num_nodes: int, seconds: float, num_feedback: int = 0,
                 drafted: bool = True) -> None:
        """One Propose answered by ``proposer``: a tree of ``num_nodes`` nodes after ``seconds``, with
        ``num_feedback`` feedback items; ``drafted`` False for a zero budget (a context sync)."""
        proposals, latency, nodes, tree_nodes, syncs, feedback = self._proposer(proposer)
        if drafted:
            proposals.inc()
            latency.observe(seconds)
            nodes.inc(num_nodes)
            tree_nodes.observe(num_nodes)
        else:
            syncs.inc()
        if num_feedback:
            feedback.inc(num_feedback)


class _DraftKVCollector:
    """The draft model's paged KV pool (``drafter_service/draft_kv.DraftKV``), read at scrape time; zeros for a
    drafter without a draft model."""

    def __init__(self, kv: Any, model_name: str) -> None:
        self.kv, self.model_name = kv, model_name

    def _families(self) -> tuple:
        return (GaugeMetricFamily(PREFIX + "drafter_kv_usage_perc", "Share of the draft model's KV pool's blocks in "
                                  "use (0-1).", labels=["model_name"]),
                CounterMetricFamily(PREFIX + "drafter_kv_evictions", "Draft caches emptied to make room in the draft "
                                    "model's KV pool (re-read when their session next drafts).",
                                    labels=["model_name"]),
                CounterMetricFamily(PREFIX + "drafter_kv_starved", "Sessions that drafted nothing for want of draft "
                                    "KV blocks.", labels=["model_name"]))

    def describe(self):
        yield from self._families()

    def collect(self):
        usage, evictions, starved = self._families()
        kv = self.kv
        usage.add_metric([self.model_name], kv.blocks_used / kv.pool.allocator.num_blocks if kv is not None else 0.0)
        evictions.add_metric([self.model_name], kv.evictions if kv is not None else 0)
        starved.add_metric([self.model_name], kv.starved if kv is not None else 0)
        yield from (usage, evictions, starved)


class _SessionsCollector:
    def __init__(self, sessions: Callable[[], Mapping[str, int]], model_name: str) -> None:
        self.sessions = sessions
        self.model_name = model_name

    def describe(self):
        yield GaugeMetricFamily(PREFIX + "drafter_num_sessions", "Open drafter sessions.", labels=LABELS)

    def collect(self):
        family = GaugeMetricFamily(PREFIX + "drafter_num_sessions", "Open drafter sessions.", labels=LABELS)
        for proposer, count in sorted(self.sessions().items()):
            family.add_metric([self.model_name, proposer], count)
        yield family
