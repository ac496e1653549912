"""Copy proposer (CopySpec): continue the context the way its longest repeated suffix continued before.

Every earlier position e of the context (prompt and earlier turns included) whose
preceding tokens agree with the context's suffix for at least ``min_match`` tokens is
a candidate; its match length L(e) is how far back they agree (capped at
``max_match``). What followed e is proposed. A candidate less than ``max_depth``
tokens before the end continues into the tokens being proposed, which repeat it
(an LZ77 overlapping copy: a loop of period n - 1 - e is continued as a loop).

Ranking: longest match first, most recent first among equals; the first
``max_matches`` distinct continuations are merged into one tree sharing prefixes,
best first, within the budget's nodes and depth.

Draft probabilities (metadata: the tree carries no draft distributions, so the
verifier uses the point-mass rule, which keeps the target distribution): a node's
is the share of candidates, weighted by match length, agreeing with its path among
those agreeing with its parent's path. So a path's product is the weighted share of
candidates that continue exactly that way, ``main_path`` follows the weighted
majority, and ``Budget.min_path_prob`` stops paths too few candidates support.
(Weighting by match length rather than counting candidates makes the main line
accepted whole slightly more often: 19.1% of steps against 18.3%, replaying
recorded outputs; L^2 and L^4 did no better.)

Per-session index (``state.scratch["copy"]``): every position of the context by
the k-gram (k = ``min_match``) ending there, in increasing order. The context is
edited only at its end (appends; rollbacks of a drafted-ahead hypothesis), so
syncing with it pops the positions of removed tokens and appends the new ones:
O(edit) per step, plus one comparison of the common prefix. A query looks up
the suffix's k-gram and measures the candidates' match lengths vectorised
(~0.1 ms on 2000 tokens of code; ~1 ms when 2000 candidates all match to the cap,
a context that is one token repeated).

Defaults, measured on the stdlib-code pair: ``min_match`` 1 (``specmesh bench``, 16
nodes x depth 10: τ 3.76 against 3.46 for 2 and 3.29 for 3, tokens/s equal within
noise); ``max_match`` 32 (8 to 64 gave the same τ replaying recorded outputs; the
cap bounds the work on repetitive contexts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget, common_prefix_len
from specmesh.tree import TokenTree

SYNC_TAIL = 64  # a context edit is assumed to touch at most this many last tokens before a full compare
WALK_BELOW = 16  # match lengths of fewer candidates are walked on the host (match_lengths)
GROUP_ON_HOST_BELOW = 64  # fewer candidates are ranked and grouped in Python (numpy's calls cost more there)


# ------------------------------------------------------------------ pure core
def match_lengths(
    context: np.ndarray,  # [num_tokens] int64
    ends: np.ndarray,  # [num_candidates] int64, positions < num_tokens - 1
    max_match: int,
) -> np.ndarray:  # [num_candidates] int64
    """For each candidate e, the largest L <= max_match with context[e-L+1 : e+1] == context[n-L : n].

    Compared in growing column blocks, so candidates that stop agreeing early cost little; a few candidates
    (most steps of a prompt lookup) are walked on the host instead, where numpy's ~12 calls would cost ~20 µs."""
    if ends.shape[0] < WALK_BELOW:
        return _match_lengths_walk(context, ends, max_match)
    n = context.shape[0]
    width = min(max_match, n)
    suffix_rev = context[::-1][:width]  # context[n-1], context[n-2], ...
    lengths = np.zeros(ends.shape[0], np.int64)
    alive = np.arange(ends.shape[0])
    start, block = 0, 4
    while alive.size and start < width:
        stop = min(width, start + block)
        idx = ends[alive, None] - np.arange(start, stop)  # [num_alive, stop - start]
        ok = (idx >= 0) & (context[np.maximum(idx, 0)] == suffix_rev[start:stop])
        full = ok.all(axis=1)
        lengths[alive] = np.where(full, stop, start + ok.argmin(axis=1))
        alive = alive[full]
        start, block = stop, block * 2
    return lengths


def _match_lengths_walk(context: np.ndarray, ends: np.ndarray, max_match: int) -> np.ndarray:
    """``match_lengths`` one candidate at a time, in Python (same values)."""
    n = context.shape[0]
    width = min(max_match, n)
    suffix = context[n - width :][::-1].tolist()  # context[n-1], context[n-2], ...
    lengths = []
    for end in ends.tolist():
        window = context[max(0, end - width + 1) : end + 1][::-1].tolist()  # context[end], context[end-1], ...
        length = 0
        while length < len(window) and window[length] == suffix[length]:
            length += 1
        lengths.append(length)
    return np.array(lengths, np.int64)


def copy_continuations(
    context: np.ndarray,  # [num_tokens] int64
    ends: np.ndarray,  # [num_candidates] int64, positions < num_tokens - 1
    depth: int,
) -> np.ndarray:  # [num_candidates, depth] int64
    """What followed each candidate, ``depth`` tokens; past the end of the context the copy repeats
    itself (period num_tokens - 1 - e), as the copied tokens would once proposed."""
    period = context.shape[0] - 1 - ends  # [num_candidates], >= 1
    return context[ends[:, None] + 1 + np.arange(depth) % period[:, None]]


def rank_candidates(ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Candidate order: longest match first, then most recent. [num_candidates] indices."""
    if ends.shape[0] < GROUP_ON_HOST_BELOW:
        keys = list(zip(lengths.tolist(), ends.tolist(), strict=True))
        return np.asarray(sorted(range(len(keys)), key=lambda i: keys[i], reverse=True), np.int64)
    return np.lexsort((-ends, -lengths))


def group_continuations(
    conts: np.ndarray,  # [num_candidates, depth] int64, in rank order
    weights: np.ndarray,  # [num_candidates] float64
) -> tuple[np.ndarray, np.ndarray]:  # [num_distinct, depth] int64, [num_distinct] float64
    """The distinct continuations in order of their best-ranked candidate, each with its candidates'
    summed weight (a loop copied from hundreds of earlier periods is one continuation)."""
    if conts.shape[0] < GROUP_ON_HOST_BELOW:  # a dict keeps the first-seen order and sums in it, as bincount does
        groups: dict[tuple[int, ...], list] = {}
        for i, (row, weight) in enumerate(zip(conts.tolist(), weights.tolist(), strict=True)):
            group = groups.get(key := tuple(row))
            if group is None:
                groups[key] = [i, weight]
            else:
                group[1] += weight
        firsts, sums = zip(*groups.values(), strict=True) if groups else ((), ())
        return conts[list(firsts)].reshape(len(firsts), conts.shape[1]), np.asarray(sums, np.float64)
    conts = np.ascontiguousarray(conts)
    keys = conts.view(np.dtype((np.void, conts.dtype.itemsize * conts.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)
    return conts[first[order]], np.bincount(inverse.ravel(), weights)[order]


def copy_tree(
    conts: np.ndarray,  # [num_distinct, depth] int64, distinct continuations, best first
    weights: np.ndarray,  # [num_distinct] float64 > 0, the weight of the candidates behind each
    max_paths: int,
    budget: Budget,
    source: str,
) -> TokenTree:
    """Merge the first ``max_paths`` continuations into one tree within the budget; draft probabilities
    as in the module docstring (the share of weight agreeing with the node among those agreeing with
    its parent), over every continuation, not only the merged ones."""
    depth = min(budget.max_depth, conts.shape[1])
    paths = conts[:max_paths, :depth]  # [num_paths, depth]
    # agree[p, c, d]: continuation c starts with path p's first d + 1 tokens
    agree = np.logical_and.accumulate(conts[None, :, :depth] == paths[:, None, :], axis=2)
    # the path probability of each path's prefix: [num_paths, depth], as lists (read one at a time below)
    share = (np.matmul(agree.transpose(0, 2, 1), weights) / weights.sum()).tolist()
    min_share, max_nodes = budget.min_path_prob, budget.max_nodes
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node: TreeBuilder's work, inlined
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    for row, shares in zip(paths.tolist(), share, strict=True):
        node, above = -1, 1.0
        for tok, here in zip(row, shares, strict=True):
            child = index.get((node, tok))
            if child is None:
                if len(tokens) >= max_nodes:
                    break
                child = index[node, tok] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                probs.append(min(1.0, here / above))
            node, above = child, here
            if here < min_share:  # SpecDec++ stop rule
                break
    n = len(tokens)
    return TokenTree(np.asarray(tokens, np.int64).reshape(n), np.asarray(parents, np.int64).reshape(n),
                     np.asarray(probs, np.float64).reshape(n), (source,) * n)


# ------------------------------------------------------------------ per-session index
@dataclass
class CopyIndex:
    """k-gram -> increasing positions where it ends (inclusive), over ``tokens``; truncates cheaply."""

    k: int
    tokens: list[int] = field(default_factory=list)  # the indexed context
    array: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64))  # [capacity]; [:len(tokens)] = tokens
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def sync(self, context: Sequence[int]) -> None:
        """Make the index describe ``context``: pop the positions past the common prefix, add the new ones."""
        common = self._common_prefix(context)
        self.truncate(common)
        self.extend(context[common:])

    def truncate(self, length: int) -> None:
        for end in range(len(self.tokens) - 1, max(length, self.k - 1) - 1, -1):
            key = tuple(self.tokens[end - self.k + 1 : end + 1])
            positions = self.ends[key]
            positions.pop()  # == end: positions are appended in increasing order
            if not positions:
                del self.ends[key]
        del self.tokens[length:]

    def extend(self, new_tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in new_tokens)
        if len(self.tokens) > self.array.shape[0]:
            grown = np.zeros(max(2 * self.array.shape[0], len(self.tokens)), np.int64)
            grown[:start] = self.array[:start]
            self.array = grown
        self.array[start : len(self.tokens)] = self.tokens[start:]
        for end in range(max(start, self.k - 1), len(self.tokens)):
            self.ends.setdefault(tuple(self.tokens[end - self.k + 1 : end + 1]), []).append(end)

    def context(self) -> np.ndarray:
        """[num_tokens] int64 view of the indexed context."""
        return self.array[: len(self.tokens)]

    def candidates(self) -> np.ndarray:
        """[num_candidates] int64: earlier positions whose k-gram equals the context's last one."""
        n = len(self.tokens)
        if n <= self.k:
            return np.zeros(0, np.int64)
        positions = self.ends.get(tuple(self.tokens[n - self.k :]), [])
        return np.asarray(positions[:-1], np.int64)  # the last is the suffix itself

    def _common_prefix(self, context: Sequence[int]) -> int:
        # edits touch the end; compare the head at C speed and walk only the tail, unless the context only grew
        # since the last sync (every step without a rejected hypothesis): then the tail compares at C speed too
        n = len(self.tokens)
        head = max(0, min(n, len(context)) - SYNC_TAIL)
        if self.tokens[:head] != _as_list(context[:head]):
            return common_prefix_len(self.tokens, context)
        if len(context) >= n and self.tokens[head:] == _as_list(context[head:n]):
            return n
        return head + common_prefix_len(self.tokens[head:], context[head:])


def _as_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list (a list as it is: a session's context is one), for comparisons at C speed."""
    return tokens if isinstance(tokens, list) else list(tokens)


# ------------------------------------------------------------------ proposer
@dataclass
class CopyProposer(Proposer):
    min_match: int = 1  # k of the index: shortest suffix match that proposes anything
    max_match: int = 32  # match lengths are measured up to this (ranking, weights)
    max_matches: int = 8  # distinct continuations merged into the tree
    name: str = "copy"

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError("copy proposer needs 1 <= min_match <= max_match")
        if self.max_matches < 1:
            raise ValueError("copy proposer needs max_matches >= 1")

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        index = self._index(state)
        index.sync(state.tokens)
        ends = index.candidates()
        if ends.size == 0:
            return TokenTree.empty()
        context = index.context()
        lengths = match_lengths(context, ends, self.max_match)
        order = rank_candidates(ends, lengths)
        conts, weights = group_continuations(copy_continuations(context, ends[order], budget.max_depth),
                                             lengths[order].astype(np.float64))
        return copy_tree(conts, weights, self.max_matches, budget, self.name)

    def prepare(self, state: DraftSessionState) -> None:
        """Index the prompt."""
        self._index(state).sync(state.tokens)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)

    def _index(self, state: DraftSessionState) -> CopyIndex:
        index = state.scratch.get(self.name)
        if index is None:
            index = state.scratch[self.name] = CopyIndex(self.min_match)
        return index


def copy_proposer(**given) -> CopyProposer:
    opts = proposer_options(given, ("min_match", "max_match", "max_matches"), "copy")
    return CopyProposer(int(opts.get("min_match", 1)), int(opts.get("max_match", 32)), int(opts.get("max_matches", 8)))
