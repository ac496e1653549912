"""Token Recycling: reuse the target's own top-k candidates, seen in verification, as drafts.

Every verification computes the target's distribution after each verified row (the
pending token and every tree node), accepted or not. The verifier reports the top-k
ids per row (``VerifyFeedback``); this proposer keeps an adjacency table
``token -> its most recent top-k successors`` and grows a draft tree from the
context's last token by following the table, best-first.

- The table is shared by every session of the drafter (the target's habits do not
  depend on the request), bounded to ``max_entries`` tokens (least recently updated
  dropped), and updated with the newest rows (replace, as in the paper).
- Each successor rank r has an estimated hit rate: before a row updates the table, the
  rank the target's top-1 had in the old entry is counted. A node's score is the
  product of its path's rank rates; the tree keeps the ``max_nodes`` best-scoring
  nodes (best-first expansion, so every kept node's parent is kept) within ``max_depth``.
  A node's draft probability is its rank rate: the conditional acceptance estimate
  fusion and the main line use.
- Trees carry no draft distributions: the verifier's point-mass rule keeps sampling lossless.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from drafter_service.tree_builders import TreeBuilder
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree


@dataclass
class RankHitRates:
    """P(target's next token == the table's rank-r successor), counted with exponential forgetting."""

    k: int
    decay: float = 0.999  # weight of older observations per new one
    prior: float = 2.0  # pseudo-observations at the prior rate 1 / (2 + r)
    hits: np.ndarray = field(init=False)  # [k + 1]; the last slot counts misses
    total: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.hits = np.zeros(self.k + 1)

    def observe(self, rank: int | None) -> None:
        self.observe_many([rank])

    def observe_many(self, ranks: list[int | None]) -> None:
        """``observe`` each rank in order, in one update (the i-th of n weighs decay^(n-1-i))."""
        added, added_total = [0.0] * (self.k + 1), 0.0
        weight = 1.0
        for rank in reversed(ranks):  # the newest weighs 1
            added[self.k if rank is None else rank] += weight
            added_total += weight
            weight *= self.decay
        self.total = self.total * weight + added_total
        self.hits *= weight  # decay ** n
        self.hits += added

    def rates(self) -> np.ndarray:
        """[k] estimated hit rate per rank."""
        prior_rate = 1.0 / (2.0 + np.arange(self.k))
        return (self.hits[: self.k] + self.prior * prior_rate) / (self.total + self.prior)


class AdjacencyTable:
    """token -> the target's most recent top-k successors (best first); bounded, thread-safe."""

    def __init__(self, k: int, max_entries: int = 1 << 20) -> None:
        self.k = k
        self.max_entries = max_entries
        self._rows: OrderedDict[int, list[int]] = OrderedDict()
        self.hit_rates = RankHitRates(k)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, token: int) -> np.ndarray | None:
        """[k] the successors of ``token``, best first; None when it has no row."""
        row = self._rows.get(token)
        return None if row is None else np.asarray(row, np.int64)

    def successors(self, token: int) -> list[int] | None:
        """``get`` as the list the table keeps (read it, never change it)."""
        return self._rows.get(token)

    def update(self, inputs: np.ndarray, topk: np.ndarray) -> None:
        """inputs: [rows] the token of each verified row; topk: [rows, >= 1] the target's successors."""
        rows_in = topk[:, : self.k].tolist()
        with self._lock:
            ranks: list[int | None] = []
            for token, succ in zip(inputs.tolist(), rows_in, strict=True):
                old = self._rows.get(token)
                if old is not None:  # how well would the old entry have predicted the target's top-1?
                    ranks.append(old.index(succ[0]) if succ[0] in old else None)
                    self._rows.move_to_end(token)
                self._rows[token] = succ
            self.hit_rates.observe_many(ranks)
            while len(self._rows) > self.max_entries:
                self._rows.popitem(last=False)


def expand_tree(table: AdjacencyTable, last_token: int, budget: Budget, source: str) -> TokenTree:
    """Best-first expansion from ``last_token`` over the table: the ``max_nodes`` paths of highest
    product of rank rates, none deeper than ``max_depth`` or scoring under ``min_path_prob``."""
    if budget.is_zero:
        return TokenTree.empty()
    rates = table.hit_rates.rates()
    builder = TreeBuilder()
    # heap of (-score, tie, parent node, depth of the child, token, rank)
    heap: list[tuple[float, int, int, int, int, int]] = []
    tie = 0

    def push_children(parent: int, token: int, score: float, depth: int) -> None:
        nonlocal tie
        succ = table.successors(token)
        if succ is None or depth >= budget.max_depth:
            return
        for rank, nxt in enumerate(succ):
            heapq.heappush(heap, (-score * rates[rank], tie, parent, depth, nxt, rank))
            tie += 1

    push_children(-1, last_token, 1.0, 0)
    while heap and len(builder) < budget.max_nodes:
        neg, _, parent, depth, token, rank = heapq.heappop(heap)
        if -neg < budget.min_path_prob:  # best-first: every node left scores lower
            break
        if builder.find(parent, token) is not None:  # a duplicate successor in one row
            continue
        node = builder.add(parent, token, float(rates[rank]), source)
        push_children(node, token, -neg, depth + 1)
    return builder.build()


@dataclass
class RecyclingProposer(Proposer):
    """Drafts from the verifier's recycled top-k rows; needs a verifier reporting top-k (``feedback_topk``)."""

    k: int = 8
    max_entries: int = 1 << 20
    name: str = "recycling"
    table: AdjacencyTable = field(init=False)

    def __post_init__(self) -> None:
        self.table = AdjacencyTable(self.k, self.max_entries)

    @property
    def feedback_topk(self) -> int:
        """Top-k width this proposer wants the verifier to report."""
        return self.k

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        for verified in feedback.verified:
            if verified.k:
                self.table.update(verified.inputs, verified.topk)

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        return expand_tree(self.table, int(state.tokens[-1]), budget, self.name)


def recycling_proposer(**given) -> RecyclingProposer:
    opts = proposer_options(given, ("k", "max_entries"), "recycling")
    return RecyclingProposer(int(opts.get("k", 8)), int(opts.get("max_entries", 1 << 20)))
