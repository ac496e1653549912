"""Tree fusion: several proposers' trees merged into one verified tree (RASD-style).

Every member proposes within the whole budget; their trees are merged into one trie
(shared prefixes become one node) and the ``max_nodes`` nodes most likely to be
accepted are kept:

- a member's node gets a calibrated conditional acceptance estimate
  ``a = P(accepted | parent accepted)`` from ``AcceptanceCalibration``: per proposer, a
  function of the node's own draft probability, learned from live outcomes;
- a node several members proposed is accepted unless all of them are wrong, taken as
  independent: ``1 - prod(1 - a_m)`` (agreement raises it);
- a path's score is the product of its nodes' estimates, so a child never outscores its
  parent and the best ``max_nodes`` form a tree (as in EAGLE-2's reranking).

Calibration learns from committed tokens only: each member tree is remembered with the
context length it was drafted from; once the orchestrator's feedback says tokens past
that point are committed, every node whose parent lies on the committed path is scored
as accepted or not (the tree's use by the verifier does not matter: the committed
tokens say what would have been accepted). Trees drafted on a hypothesis that was then
taken back are dropped.

Fused trees carry no draft distributions: the verifier's point-mass rule keeps sampling
lossless for any tree (a sampled member's tokens are just accepted less often than with
its own distributions).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from drafter_service.proposer import DraftSessionState, Proposer, make_proposer, proposer_names, proposer_spec
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree

DEFAULT_MEMBERS = ("copy", "retrieval", "recycling")


@dataclass
class AcceptanceCalibration:
    """Per source: P(node accepted | parent accepted) by bucket of the node's draft probability.

    Each bucket holds exponentially forgotten counts; its estimate is shrunk towards the node's own
    draft probability by ``prior_weight`` pseudo-observations, so a proposer starts trusted as it
    claims and ends where the evidence says."""

    buckets: int = 5
    prior_weight: float = 4.0
    decay: float = 0.999  # per observation of the same source
    _hits: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # source -> [buckets]
    _trials: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def _bucket(self, draft_prob: float) -> int:
        return min(self.buckets - 1, max(0, int(draft_prob * self.buckets)))

    def estimate(self, source: str, draft_prob: float) -> float:
        draft_prob = min(1.0, max(0.0, float(draft_prob)))
        b = self._bucket(draft_prob)
        hits = self._hits.get(source)
        h, t = (hits[b], self._trials[source][b]) if hits is not None else (0.0, 0.0)
        return (h + self.prior_weight * draft_prob) / (t + self.prior_weight)

    def estimates(self, sources: Sequence[str], draft_probs: np.ndarray) -> np.ndarray:
        """``estimate`` of every node at once: [n] sources (or () = all ""), [n] draft probabilities -> [n]."""
        probs = np.clip(np.asarray(draft_probs, np.float64), 0.0, 1.0)
        n = probs.shape[0]
        names = set(sources) if sources else {""}
        out = np.empty(n)
        for source in names:
            where = slice(None) if len(names) == 1 else np.asarray([s == source for s in sources])
            p = probs[where]
            hits = self._hits.get(source)
            if hits is None:
                h = t = 0.0
            else:
                b = np.minimum(self.buckets - 1, (p * self.buckets).astype(np.int64))
                h, t = hits[b], self._trials[source][b]
            out[where] = (h + self.prior_weight * p) / (t + self.prior_weight)
        return out

    def observe(self, source: str, draft_prob: float, accepted: bool) -> None:
        self.observe_many(source, [draft_prob], [accepted])

    def observe_many(self, source: str, draft_probs: Sequence[float], accepted: Sequence[bool]) -> None:
        """``observe`` of each (draft probability, outcome) in order, in one update: each observation forgets the
        earlier ones by ``decay``, so the i-th of n weighs decay^(n-1-i) and the counts before all of them decay^n."""
        n = len(draft_probs)
        if not n:
            return
        if source not in self._hits:
            self._hits[source], self._trials[source] = np.zeros(self.buckets), np.zeros(self.buckets)
        add_hits, add_trials = [0.0] * self.buckets, [0.0] * self.buckets
        weight = 1.0
        for prob, ok in zip(reversed(draft_probs), reversed(accepted), strict=True):  # the newest weighs 1
            b = self._bucket(min(1.0, max(0.0, float(prob))))
            add_trials[b] += weight
            if ok:
                add_hits[b] += weight
            weight *= self.decay
        for counts, added in ((self._hits[source], add_hits), (self._trials[source], add_trials)):
            counts *= weight  # decay ** n
            counts += added

    def table(self) -> dict[str, list[tuple[float, float]]]:
        """source -> per bucket (observed acceptance, weight of evidence); for logs and tests."""
        return {s: [(float(h / t) if t else float("nan"), float(t)) for h, t in zip(self._hits[s], self._trials[s], strict=True)]
                for s in sorted(self._hits)}


def tree_outcomes(tree: TokenTree, truth: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, accepted) for every node of ``tree`` whose parent lies on the path ``truth`` spells (the
    root counts as on it) and whose position ``truth`` covers; nodes below a miss are not judged."""
    out: list[tuple[int, bool]] = []
    if not tree.num_nodes:
        return out
    tokens = tree.tokens.tolist()
    node, depth = -1, 0
    while depth < len(truth):
        nxt, want = None, int(truth[depth])
        for child in tree.children_of(node):
            hit = tokens[child] == want
            out.append((child, hit))
            if hit and nxt is None:
                nxt = child
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return out


def fuse_trees(trees: Sequence[TokenTree], calibration: AcceptanceCalibration, budget: Budget,
               min_score: float = 0.0) -> TokenTree:
    """Merge ``trees`` into one of at most ``budget.max_nodes`` nodes and ``budget.max_depth`` levels,
    keeping the nodes of highest estimated path acceptance (see the module docstring), none whose
    estimate is below ``min_score`` or ``budget.min_path_prob``.

    The union is a trie of integer nodes, numbered in first-seen order (so parents first), each keyed by
    (parent node, token); the kept nodes are the best by (score, shallower, first seen), as
    ``best_paths_tree`` ranks paths."""
    if budget.is_zero:
        return TokenTree.empty()
    node_of: dict[tuple[int, int], int] = {}  # (parent node or -1, token) -> trie node
    parent: list[int] = []  # per trie node
    token: list[int] = []
    depth: list[int] = []
    miss: list[float] = []  # P(every member proposing it is wrong)
    best: list[float] = []  # the best member estimate ...
    best_source: list[str] = []  # ... and its source
    for tree in trees:
        n = tree.num_nodes
        if not n:
            continue
        estimates = calibration.estimates(tree.sources, tree.draft_probs).tolist()
        sources = tree.sources or ("",) * n
        here = [-1] * n  # the tree's node -> its trie node
        level = [0] * n
        for i, (par, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
            d = level[i] = level[par] + 1 if par >= 0 else 1
            if d > budget.max_depth:
                continue
            key = (here[par] if par >= 0 else -1, tok)
            u = node_of.get(key)
            if u is None:
                u = node_of[key] = len(miss)
                parent.append(key[0])
                token.append(tok)
                depth.append(d)
                miss.append(1.0)
                best.append(-1.0)
                best_source.append("")
            here[i] = u
            est = estimates[i]
            miss[u] *= 1.0 - est
            if est > best[u]:
                best[u], best_source[u] = est, sources[i]
    if not miss:
        return TokenTree.empty()
    score = [0.0] * len(miss)
    for u, (par, m) in enumerate(zip(parent, miss, strict=True)):  # parents first
        score[u] = (score[par] if par >= 0 else 1.0) * (1.0 - m)
    scores, depths = np.asarray(score), np.asarray(depth)
    ranked = np.lexsort((np.arange(len(score)), depths, -scores))
    kept = ranked[scores[ranked] >= max(min_score, budget.min_path_prob)][: budget.max_nodes]
    kept = kept[np.lexsort((kept, depths[kept]))].tolist()  # parents first, as first seen within a level
    new_index = {u: i for i, u in enumerate(kept)}
    return TokenTree(
        np.asarray([token[u] for u in kept], np.int64).reshape(len(kept)),
        np.asarray([new_index[parent[u]] if parent[u] >= 0 else -1 for u in kept], np.int64).reshape(len(kept)),
        np.asarray([max(1e-6, 1.0 - miss[u]) for u in kept], np.float64).reshape(len(kept)),
        tuple(best_source[u] for u in kept),
    )


ANCHOR = 8  # committed tokens before a hypothesis compared too when checking a drafted tree still applies


@dataclass
class _Drafted:
    """Member trees waiting to be judged: drafted from ``tokens[:length]``, which ended with ``tail``
    (the hypothesis drafted on, if any, and ANCHOR committed tokens before it)."""

    length: int
    tail: tuple[int, ...]
    trees: list[TokenTree]


@dataclass
class FusedProposer(Proposer):
    members: list[Proposer]
    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    name: str = "fused"
    max_pending: int = 8  # member trees remembered per session for calibration
    min_score: float = 0.0  # leave out nodes whose estimated path acceptance is lower

    @property
    def feedback_topk(self) -> int:
        return max((m.feedback_topk for m in self.members), default=0)

    @property
    def feedback_min_ngram(self) -> int:
        return max((m.feedback_min_ngram for m in self.members), default=0)

    @property
    def feedback_window(self) -> tuple[int, int] | None:
        return next((m.feedback_window for m in self.members if m.feedback_window is not None), None)

    @property
    def feedback_features(self) -> bool:  # a Falcon member reads the target's features
        return any(m.feedback_features for m in self.members)

    def prepare(self, state: DraftSessionState) -> None:
        state.scratch[self.name] = deque(maxlen=self.max_pending)
        for member in self.members:
            member.prepare(state)

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        for member in self.members:
            member.observe(state, feedback)
        if state.committed_len:  # feedback.committed_len, clamped to the context by the drafter
            self._calibrate(state, state.committed_len)

    def _calibrate(self, state: DraftSessionState, committed: int) -> None:
        pending: deque[_Drafted] = state.scratch.setdefault(self.name, deque(maxlen=self.max_pending))
        keep: list[_Drafted] = []
        tokens = state.tokens
        outcomes: dict[str, tuple[list[float], list[bool]]] = {}  # source -> its nodes' (draft probs, outcomes)
        for drafted in pending:
            lo = drafted.length - len(drafted.tail)
            if drafted.length > len(tokens) or tuple(tokens[lo : drafted.length]) != drafted.tail:
                continue  # drafted on a hypothesis that was taken back: never verified
            if committed <= drafted.length:
                keep.append(drafted)  # nothing after it committed yet
                continue
            truth = tokens[drafted.length : committed]
            for tree in drafted.trees:
                probs = tree.draft_probs
                for node, accepted in tree_outcomes(tree, truth):
                    probs_of, accepted_of = outcomes.setdefault(tree.sources[node] if tree.sources else "", ([], []))
                    probs_of.append(float(probs[node]))
                    accepted_of.append(accepted)
        for source, (probs_of, accepted_of) in outcomes.items():  # each source's in order, in one update
            self.calibration.observe_many(source, probs_of, accepted_of)
        pending.clear()
        pending.extend(keep)

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        trees = []
        for member in self.members:
            if trees and budget.expired():
                break
            trees.append(member.propose(state, budget))
        pending = state.scratch.setdefault(self.name, deque(maxlen=self.max_pending))
        committed = state.committed_len or len(state.tokens)
        tail = tuple(state.tokens[max(0, min(committed, len(state.tokens)) - ANCHOR) :])
        pending.append(_Drafted(len(state.tokens), tail, trees))
        return fuse_trees(trees, self.calibration, budget, self.min_score)

    def release(self, state: DraftSessionState) -> None:
        for member in self.members:
            member.release(state)
        state.scratch.pop(self.name, None)


def parse_members(members: str | Sequence[str] | None) -> list[str]:
    """``"copy+retrieval"`` or ``["copy", "retrieval"]`` -> names; None -> DEFAULT_MEMBERS."""
    if members is None:
        return list(DEFAULT_MEMBERS)
    names = [m.strip() for m in (members.replace(",", "+").split("+") if isinstance(members, str) else members)]
    names = [m for m in names if m]
    if not names or "fused" in names or len(set(names)) != len(names):
        raise ValueError(f"fused members must be distinct proposer names other than 'fused', got {members!r}")
    lossy = [n for n in names if n in proposer_names() and proposer_spec(n).lossy]
    if lossy:  # its trees need its own (lossy) acceptance, which a fused request never gets
        raise ValueError(f"fused members cannot include {', '.join(lossy)}: a lossy proposer runs only when a "
                         "request asks for it by name")
    return names


def member_options(names: Sequence[str], given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each member's own options among ``given``: ``NAME.OPTION`` keys (``falcon.head=DIR``), by member name;
    ValueError for a key naming no member."""
    own: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in given.items():
        if "." not in key:
            continue
        member, _, option = key.partition(".")
        if member not in own or not option:
            raise ValueError(f"fused option {key!r} names no member option: MEMBER.OPTION with MEMBER one of "
                             f"{'+'.join(names)}")
        own[member][option] = value
    return own


def fused_proposer(members: str | Sequence[str] | None = None, min_score: float = 0.1, **given) -> FusedProposer:
    """``min_score`` 0.1: with 24 nodes, nodes below it cost more verify time than they return
    (measured with `specmesh bench` on the stdlib pair). ``given``: the host's resources, which every member
    gets, and members' own options as ``NAME.OPTION`` (``fused:members=copy+falcon,falcon.head=DIR``)."""
    names = parse_members(members)
    own = member_options(names, given)
    resources = {key: value for key, value in given.items() if "." not in key}
    if resources.get("draft_runner") is None and any(n.startswith("draft_model") for n in names):
        raise ValueError(f"fused members {'+'.join(names)} include a draft model, and there is none (--draft DIR)")
    return FusedProposer([make_proposer(name, **resources, **own[name]) for name in names], min_score=float(min_score))
