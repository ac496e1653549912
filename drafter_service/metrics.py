"""Prometheus metrics of a drafter server (`specmesh drafter`), by proposer.

The servicer calls ``proposed`` once per Propose it answered; open sessions are read at scrape time
from ``sessions()`` (proposer -> sessions), so opening and closing sessions costs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from specmesh.metrics import COUNT_BUCKETS, PREFIX, SECONDS_BUCKETS, new_registry


class DrafterMetrics:
    """A drafter's metrics in ``registry`` (default: a new one, ``.registry``). ``sessions``: returns the open
    sessions per proposer, called on the HTTP thread at each scrape (None: no sessions gauge)."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 sessions: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.registry = registry = new_registry(registry)
        label = ["proposer"]
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
        if sessions is not None:
            registry.register(_SessionsCollector(sessions))

    def proposed(self, proposer: str, num_nodes: int, seconds: float, num_feedback: int = 0,
                 drafted: bool = True) -> None:
        """One Propose answered by ``proposer``: a tree of ``num_nodes`` nodes after ``seconds``, with
        ``num_feedback`` feedback items; ``drafted`` False for a zero budget (a context sync)."""
        children = self._children.get(proposer)
        if children is None:
            children = self._children[proposer] = tuple(
                m.labels(proposer) for m in (self.proposals, self.seconds, self.nodes, self.tree_nodes, self.syncs,
                                             self.feedback))
        proposals, latency, nodes, tree_nodes, syncs, feedback = children
        if drafted:
            proposals.inc()
            latency.observe(seconds)
            nodes.inc(num_nodes)
            tree_nodes.observe(num_nodes)
        else:
            syncs.inc()
        if num_feedback:
            feedback.inc(num_feedback)


class _SessionsCollector:
    def __init__(self, sessions: Callable[[], Mapping[str, int]]) -> None:
        self.sessions = sessions

    def describe(self):
        yield GaugeMetricFamily(PREFIX + "drafter_num_sessions", "Open drafter sessions.", labels=["proposer"])

    def collect(self):
        family = GaugeMetricFamily(PREFIX + "drafter_num_sessions", "Open drafter sessions.", labels=["proposer"])
        for proposer, count in sorted(self.sessions().items()):
            family.add_metric([proposer], count)
        yield family
