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
from drafter_service.tree_builders import best_paths_tree
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

    def observe(self, source: str, draft_prob: float, accepted: bool) -> None:
        if source not in self._hits:
            self._hits[source], self._trials[source] = np.zeros(self.buckets), np.zeros(self.buckets)
        hits, trials = self._hits[source], self._trials[source]
        hits *= self.decay
        trials *= self.decay
        b = self._bucket(min(1.0, max(0.0, float(draft_prob))))
        hits[b] += float(accepted)
        trials[b] += 1.0

    def table(self) -> dict[str, list[tuple[float, float]]]:
        """source -> per bucket (observed acceptance, weight of evidence); for logs and tests."""
        return {s: [(float(h / t) if t else float("nan"), float(t)) for h, t in zip(self._hits[s], self._trials[s], strict=True)]
                for s in sorted(self._hits)}


def tree_outcomes(tree: TokenTree, truth: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, accepted) for every node of ``tree`` whose parent lies on the path ``truth`` spells (the
    root counts as on it) and whose position ``truth`` covers; nodes below a miss are not judged."""
    out: list[tuple[int, bool]] = []
    node, depth = -1, 0
    while depth < len(truth):
        nxt = None
        for child in tree.children_of(node):
            hit = int(tree.tokens[child]) == int(truth[depth])
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
    estimate is below ``min_score`` or ``budget.min_path_prob``."""
    if budget.is_zero:
        return TokenTree.empty()
    miss: dict[tuple[int, ...], float] = {}  # path -> P(every member proposing it is wrong), first-seen order
    best: dict[tuple[int, ...], tuple[float, str]] = {}  # path -> (best member estimate, its source)
    for tree in trees:
        keys: list[tuple[int, ...]] = []
        for i in range(tree.num_nodes):
            parent = int(tree.parents[i])
            key = (keys[parent] if parent >= 0 else ()) + (int(tree.tokens[i]),)
            keys.append(key)
            if len(key) > budget.max_depth:
                continue
            source = tree.sources[i] if tree.sources else ""
            est = calibration.estimate(source, float(tree.draft_probs[i]))
            miss[key] = miss.get(key, 1.0) * (1.0 - est)
            if est > best.get(key, (-1.0, ""))[0]:
                best[key] = (est, source)
    score: dict[tuple[int, ...], float] = {}
    for key in sorted(miss, key=len):  # parents first
        score[key] = (score[key[:-1]] if len(key) > 1 else 1.0) * (1.0 - miss[key])
    scored = {key: (score[key], max(1e-6, 1.0 - m), best[key][1]) for key, m in miss.items()}
    return best_paths_tree(scored, budget.max_nodes, max(min_score, budget.min_path_prob))


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
        for drafted in pending:
            lo = drafted.length - len(drafted.tail)
            if drafted.length > len(tokens) or tuple(tokens[lo : drafted.length]) != drafted.tail:
                continue  # drafted on a hypothesis that was taken back: never verified
            if committed <= drafted.length:
                keep.append(drafted)  # nothing after it committed yet
                continue
            truth = tokens[drafted.length : committed]
            for tree in drafted.trees:
                for node, accepted in tree_outcomes(tree, truth):
                    source = tree.sources[node] if tree.sources else ""
                    self.calibration.observe(source, float(tree.draft_probs[node]), accepted)
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
