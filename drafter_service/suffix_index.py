"""A frequency-counted suffix trie over token sequences, compiled (SuffixDecoding's index).

A node is a string of at most ``depth`` tokens that occurs in the indexed sequences: ``count`` is how often it
occurs, ``pos`` where its newest occurrence ends. Strings are materialised lazily: a suffix is walked down the
nodes only until it reaches a string that occurs once; below that its continuation is read from the corpus at the
node's ``pos`` (an implicit chain), and the chain gets its next node only when a second occurrence walks into it.
So the trie holds the repeated structure of the text (a node per repeated string and one per first divergence),
not ``depth`` nodes per token, and appending a token costs one step for each suffix still inside repeated
structure (at most ``depth``).

Operations, compiled with numba and run without the interpreter lock (``nogil``), so a drafter thread drafting
for one request does not stop the engine's step or another thread's drafting:

- ``extend``: append tokens to the open sequence (a request's context as tokens commit);
- ``close``: end the open sequence (no continuation ever reads past its end);
- forgetting the oldest closed sequence (the global index keeps a bounded number of tokens; a node's ``pos``
  always names its newest occurrence, so forgetting the oldest never leaves a node pointing at it);
- ``speculate``: the tree of the most frequent continuations of the context's longest match (below);
- ``propose``: a request's whole step in one call: its new tokens into its own index, then speculation from it
  and from the global index, the better tree kept (a call into compiled code costs ~1 µs per array it takes,
  so the step makes one).

Speculation, as SuffixDecoding defines it: find the longest suffix of the context that occurs with a continuation
(``match_len``, fewer tokens than the depth, so that every occurrence's next token is a node); from its node
grow a tree best first by the empirical probability of each path (``count(child) / count(node)``: the share of the
node's occurrences that continued so, multiplied down the path), until ``max_spec_factor * match_len + max_spec_offset`` nodes (the longer
the match, the further it trusts it), the budget's nodes or depth, or a path below ``min_token_prob``. Shorter
matches (halving) are tried too and the tree with the larger expected number of accepted tokens (the sum of its
paths' probabilities) wins; ties go to the longer match. Below the trie's depth, or in an implicit chain, a path
follows the newest occurrence with probability 1 (one witness).

Layout: per index four int64 arrays (a numba call takes arrays): ``nodes`` [capacity, 9] (the columns below; free
rows chained through NEXT), ``corpus`` [capacity, 2] (token, end of its sequence; row = position - base),
``table`` [2^k, 2] (an open-addressing map (parent, token) -> child, linear probing, tombstones, at most half
full), ``meta`` (the scalars and the open suffixes' nodes). Capacity grows in Python before a call that may need
it (the bound is exact: a token makes at most one node per open suffix).

Why hand-written: no library keeps a counted suffix structure over integer tokens that grows a token at a time,
forgets its oldest sequences and answers in microseconds without the interpreter lock (Arctic Inference's is C++
inside its vLLM plugin, not a library to call). numba compiles it at first use (cached beside the module;
``warm_up`` does it when a proposer is built, and the Docker image ships the cache) and needs no compiler at install; the map is hand-written because numba's typed dict costs ~3 µs to pass into every
call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import float64, int64, njit

# node columns: the children of a node are a doubly linked list (CHILD: first, LAST: last, NEXT / PREV) kept
# roughly by count, most frequent first (a new child goes last; a child whose count passes its predecessor's moves
# up, a few places per occurrence), so a tree reads a hub's likely children without walking all of them
COUNT, POS, PARENT, TOKEN, DEPTH, CHILD, NEXT, PREV, LAST = range(9)
NODE_COLUMNS = 9
BUBBLE = 4  # places a child may move up per occurrence
ROOT = 0
KEY_SHIFT = 24  # child key = parent << KEY_SHIFT | token: token ids below 2^24
MAX_TOKEN = 1 << KEY_SHIFT
EMPTY, TOMBSTONE = -1, -2  # table keys of a free slot and of a deleted one
OPEN_END = np.iinfo(np.int64).max  # the open sequence's end: its chains read up to the corpus' end
HASH_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (Fibonacci hashing)
# meta: the high-water node row, the free list's head (-1: none), live nodes, the corpus' end (an absolute
# position), the position of corpus row 0, the open sequence's start (-1: none), occupied table slots (tombstones
# too), log2 of the table's size, the depth; then the node of each open suffix by start % depth (-1: implicit)
M_USED, M_FREE, M_LIVE, M_END, M_BASE, M_OPEN, M_TABLE_USED, M_TABLE_BITS, M_DEPTH = range(9)
M_OPEN_NODES = 9
# The helpers called with constants (-1, 0, 1 in some argument) get one signature each: numba otherwise compiles a
# specialisation per combination of literal arguments (seven of _push), most of a cold cache's compile time
_INT_ROWS, _INTS, _FLOAT_ROWS = int64[:, ::1], int64[::1], float64[:, ::1]


# ------------------------------------------------------------------ compiled core: the map
@njit(nogil=True, cache=True, inline="always")
def _slot(meta, key):
    bits = meta[M_TABLE_BITS]
    return ((key * HASH_MULT) >> (64 - bits)) & ((1 << bits) - 1)


@njit(int64(_INT_ROWS, _INTS, int64, int64), nogil=True, cache=True)
def _child(table, meta, parent, token):
    """The child of ``parent`` by ``token``, or -1."""
    key = (parent << KEY_SHIFT) | token
    mask = table.shape[0] - 1
    i = _slot(meta, key)
    while True:
        k = table[i, 0]
        if k == key:
            return table[i, 1]
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@njit(nogil=True, cache=True)
def _table_put(table, meta, key, value):
    mask = table.shape[0] - 1
    i = _slot(meta, key)
    while table[i, 0] >= 0:  # the key is never present: a new child
        i = (i + 1) & mask
    if table[i, 0] == EMPTY:
        meta[M_TABLE_USED] += 1
    table[i, 0] = key
    table[i, 1] = value


@njit(nogil=True, cache=True)
def _table_delete(table, meta, key):
    mask = table.shape[0] - 1
    i = _slot(meta, key)
    while table[i, 0] != key:
        i = (i + 1) & mask
    table[i, 0] = TOMBSTONE


@njit(nogil=True, cache=True)
def _rehash(table, meta, bits):
    """The map in a table of 2^bits slots, tombstones dropped."""
    fresh = np.full((1 << bits, 2), EMPTY, np.int64)
    meta[M_TABLE_BITS] = bits
    meta[M_TABLE_USED] = 0
    for i in range(table.shape[0]):
        if table[i, 0] >= 0:
            _table_put(fresh, meta, table[i, 0], table[i, 1])
    return fresh


# ------------------------------------------------------------------ compiled core: updates
@njit(nogil=True, cache=True)
def _new_node(nodes, table, meta, parent, token, pos):
    node = meta[M_FREE]
    if node >= 0:
        meta[M_FREE] = nodes[node, NEXT]
    else:
        node = meta[M_USED]
        meta[M_USED] += 1
    meta[M_LIVE] += 1
    nodes[node, COUNT] = 1
    nodes[node, POS] = pos
    nodes[node, PARENT] = parent
    nodes[node, TOKEN] = token
    nodes[node, DEPTH] = nodes[parent, DEPTH] + 1
    nodes[node, CHILD] = -1
    nodes[node, LAST] = -1
    last = nodes[parent, LAST]  # count 1: the list's end
    nodes[node, PREV] = last
    nodes[node, NEXT] = -1
    if last >= 0:
        nodes[last, NEXT] = node
    else:
        nodes[parent, CHILD] = node
    nodes[parent, LAST] = node
    _table_put(table, meta, (parent << KEY_SHIFT) | token, node)
    return node


@njit(nogil=True, cache=True)
def _bubble(nodes, node):
    """Move ``node`` up its siblings' list past those of a lower count, at most BUBBLE places."""
    parent = nodes[node, PARENT]
    for _ in range(BUBBLE):
        prev = nodes[node, PREV]
        if prev < 0 or nodes[prev, COUNT] >= nodes[node, COUNT]:
            return
        before, after = nodes[prev, PREV], nodes[node, NEXT]  # before, prev, node, after -> before, node, prev, after
        if before >= 0:
            nodes[before, NEXT] = node
        else:
            nodes[parent, CHILD] = node
        nodes[node, PREV], nodes[node, NEXT] = before, prev
        nodes[prev, PREV], nodes[prev, NEXT] = node, after
        if after >= 0:
            nodes[after, PREV] = prev
        else:
            nodes[parent, LAST] = prev


@njit(nogil=True, cache=True)
def _drop_node(nodes, table, meta, node):
    parent = nodes[node, PARENT]
    prev, nxt = nodes[node, PREV], nodes[node, NEXT]
    if prev >= 0:
        nodes[prev, NEXT] = nxt
    else:
        nodes[parent, CHILD] = nxt
    if nxt >= 0:
        nodes[nxt, PREV] = prev
    else:
        nodes[parent, LAST] = prev
    _table_delete(table, meta, (parent << KEY_SHIFT) | nodes[node, TOKEN])
    nodes[node, COUNT] = 0
    nodes[node, NEXT] = meta[M_FREE]
    meta[M_FREE] = node
    meta[M_LIVE] -= 1


@njit(nogil=True, cache=True)
def _chain_next(corpus, meta, pos):
    """The corpus position after ``pos`` in its sequence, or -1 at the sequence's (or the corpus') end."""
    nxt = pos + 1
    if nxt >= meta[M_END] or nxt >= corpus[pos - meta[M_BASE], 1]:
        return -1
    return nxt


@njit(nogil=True, cache=True)
def _step(nodes, corpus, table, meta, cur, token, pos):
    """Extend the suffix at node ``cur`` by ``token`` (at corpus position ``pos``): its node below, or -1 once
    the suffix is a string that occurs only here (its continuation is implicit from then on)."""
    child = _child(table, meta, cur, token)
    if child >= 0:
        nodes[child, COUNT] += 1
        if nodes[child, COUNT] == 2 and nodes[child, CHILD] < 0 and nodes[child, DEPTH] < meta[M_DEPTH]:
            # a second occurrence: the first one's continuation becomes a node of its own
            old = _chain_next(corpus, meta, nodes[child, POS])
            if old >= 0:
                _new_node(nodes, table, meta, child, corpus[old - meta[M_BASE], 0], old)
        nodes[child, POS] = pos
        _bubble(nodes, child)
        return child
    if cur != ROOT and nodes[cur, COUNT] == 1 and nodes[cur, CHILD] < 0:
        return -1  # cur occurs only here: the corpus holds its continuation
    return _new_node(nodes, table, meta, cur, token, pos)


@njit(nogil=True, cache=True)
def _extend(nodes, corpus, table, meta, tokens, lo, hi):
    """Append tokens[lo:hi] to the open sequence (opened if none is; capacity reserved by the caller)."""
    depth = meta[M_DEPTH]
    if meta[M_OPEN] < 0:
        meta[M_OPEN] = meta[M_END]
    for i in range(lo, hi):
        pos = meta[M_END]
        token = tokens[i]
        corpus[pos - meta[M_BASE], 0] = token
        corpus[pos - meta[M_BASE], 1] = OPEN_END
        meta[M_END] = pos + 1
        for start in range(max(meta[M_OPEN], pos - depth + 1), pos + 1):  # each suffix shorter than the depth
            slot = M_OPEN_NODES + start % depth
            cur = ROOT if start == pos else meta[slot]
            meta[slot] = -1 if cur < 0 else _step(nodes, corpus, table, meta, cur, token, pos)


@njit(nogil=True, cache=True)
def _close(corpus, meta):
    start = meta[M_OPEN]
    if start < 0:
        return
    for pos in range(start, meta[M_END]):
        corpus[pos - meta[M_BASE], 1] = meta[M_END]
    meta[M_OPEN_NODES:] = -1
    meta[M_OPEN] = -1


@njit(nogil=True, cache=True)
def _evict(nodes, corpus, table, meta, start, end):
    """Forget the closed sequence corpus[start:end], the oldest one held."""
    depth = meta[M_DEPTH]
    path = np.empty(depth, np.int64)
    base = meta[M_BASE]
    for s in range(start, end):
        n, cur = 0, ROOT
        for pos in range(s, min(end, s + depth)):
            child = _child(table, meta, cur, corpus[pos - base, 0])
            if child < 0:
                break
            path[n] = child
            n += 1
            cur = child
        for i in range(n - 1, -1, -1):  # deepest first: a node that drops to 0 has no other descendants
            node = path[i]
            nodes[node, COUNT] -= 1
            if nodes[node, COUNT] == 0:
                _drop_node(nodes, table, meta, node)


# ------------------------------------------------------------------ compiled core: queries
@njit(nogil=True, cache=True)
def _walk(nodes, corpus, table, meta, pattern, start, stop):
    """Follow pattern[start:stop] from the root: (node, chain position) where it ends (chain position -1: at a
    node; else in the implicit chain at that corpus position), or (-1, -1) when it does not occur."""
    cur, chain = ROOT, -1
    base = meta[M_BASE]
    for i in range(start, stop):
        token = pattern[i]
        if chain < 0:
            child = _child(table, meta, cur, token)
            if child >= 0:
                cur = child
                continue
            if cur == ROOT or nodes[cur, CHILD] >= 0:
                return -1, -1
            chain = nodes[cur, POS]  # below a leaf or the trie's depth: its newest occurrence's continuation
        nxt = _chain_next(corpus, meta, chain)
        if nxt < 0 or corpus[nxt - base, 0] != token:
            return -1, -1
        chain = nxt
    return cur, chain


@njit(nogil=True, cache=True)
def _has_continuation(nodes, corpus, meta, cur, chain):
    if chain >= 0:
        return _chain_next(corpus, meta, chain) >= 0
    if cur < 0:
        return False
    if nodes[cur, CHILD] >= 0:
        return True
    return cur != ROOT and _chain_next(corpus, meta, nodes[cur, POS]) >= 0


@njit(nogil=True, cache=True)
def _longest_match(nodes, corpus, table, meta, pattern, start, stop, min_match):
    """The longest suffix of pattern[start:stop] (>= min_match tokens) that occurs with a continuation: its
    length, or 0. Occurring with a continuation is closed under taking suffixes: a binary search finds it."""
    lo, hi = 0, stop - start  # lo: known to occur (0: the empty string); hi: an upper bound
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cur, chain = _walk(nodes, corpus, table, meta, pattern, stop - mid, stop)
        if _has_continuation(nodes, corpus, meta, cur, chain):
            lo = mid
        else:
            hi = mid - 1
    return lo if lo >= min_match else 0


@njit(int64(_INT_ROWS, _FLOAT_ROWS, int64, int64, int64, int64, int64, float64, float64, float64), nogil=True, cache=True)
def _push(frontier, probs, size, node, chain, parent, depth, cond, path, min_prob):
    """Add a candidate to the frontier (int rows: node, chain position, tree parent, depth; float rows: the
    conditional and the path probability); a full frontier drops its least likely entry for a likelier one."""
    if path < min_prob:
        return size
    slot = size
    if size == frontier.shape[0]:
        slot = 0
        for i in range(1, size):
            if probs[i, 1] < probs[slot, 1]:
                slot = i
        if probs[slot, 1] >= path:
            return size
    else:
        size += 1
    frontier[slot, 0], frontier[slot, 1], frontier[slot, 2], frontier[slot, 3] = node, chain, parent, depth
    probs[slot, 0], probs[slot, 1] = cond, path
    return size


@njit(int64(_INT_ROWS, _INT_ROWS, _INTS, int64, int64, int64, int64, float64, float64, int64, _INT_ROWS, _FLOAT_ROWS,
           int64), nogil=True, cache=True)
def _push_children(nodes, corpus, meta, cur, chain, parent, depth, path, min_prob, fanout, frontier, probs, size):
    """The children of (cur, chain) into the frontier: a node's, each with the share of cur's occurrences that
    continue with it (the newest not counted when nothing follows it yet: a request's own context), read most
    frequent first, at most ``fanout`` of them and none after the first below ``min_prob``; an implicit chain's
    one next token, with probability 1."""
    if chain < 0 and nodes[cur, CHILD] >= 0:
        occurrences = nodes[cur, COUNT]
        if _chain_next(corpus, meta, nodes[cur, POS]) < 0:
            occurrences -= 1
        occurrences = max(occurrences, 1)
        child, read = nodes[cur, CHILD], 0
        while child >= 0 and read < fanout:
            cond = min(1.0, nodes[child, COUNT] / occurrences)
            if path * cond < min_prob:
                break  # the rest are (roughly) rarer still
            size = _push(frontier, probs, size, child, -1, parent, depth, cond, path * cond, min_prob)
            child = nodes[child, NEXT]
            read += 1
        return size
    at = chain if chain >= 0 else (nodes[cur, POS] if cur != ROOT else -1)
    if at < 0:
        return size
    nxt = _chain_next(corpus, meta, at)
    if nxt < 0:
        return size
    return _push(frontier, probs, size, -1, nxt, parent, depth, 1.0, path, min_prob)


@njit(nogil=True, cache=True)
def _grow(nodes, corpus, meta, cur, chain, max_nodes, max_depth, min_prob, out, out_probs, row):
    """The best-first tree below (cur, chain) into out[row] (tokens), out[row + 1] (parents) and
    out_probs[row // 2] (conditional probabilities): (num_nodes, the sum of the path probabilities)."""
    cap = 4 * max_nodes + 16
    frontier = np.empty((cap, 4), np.int64)
    probs = np.empty((cap, 2), np.float64)
    size = _push_children(nodes, corpus, meta, cur, chain, -1, 1, 1.0, min_prob, max_nodes, frontier, probs, 0)
    count, score = 0, 0.0
    base = meta[M_BASE]
    while size > 0 and count < max_nodes:
        best = 0
        for i in range(1, size):
            if probs[i, 1] > probs[best, 1]:
                best = i
        node, chain_pos, parent, depth = frontier[best, 0], frontier[best, 1], frontier[best, 2], frontier[best, 3]
        cond, path = probs[best, 0], probs[best, 1]
        size -= 1  # the last entry fills the hole
        frontier[best] = frontier[size]
        probs[best] = probs[size]
        out[row, count] = corpus[chain_pos - base, 0] if chain_pos >= 0 else nodes[node, TOKEN]
        out[row + 1, count] = parent
        out_probs[row // 2, count] = cond
        score += path
        if depth < max_depth:
            size = _push_children(nodes, corpus, meta, node, chain_pos, count, depth + 1, path, min_prob,
                                  max_nodes, frontier, probs, size)
        count += 1
    return count, score


@njit(nogil=True, cache=True)
def _speculate(nodes, corpus, table, meta, pattern, start, stop, min_match, max_nodes, max_depth, min_prob,
               spec_factor, spec_offset, out, out_probs):
    """The best tree over the longest match of pattern[start:stop] and its halvings, into out[0:2] / out_probs[0]
    (out[2:4] / out_probs[1]: scratch): (num_nodes, score, match_len)."""
    best_n, best_score, best_len = 0, 0.0, 0
    start = max(start, stop - (meta[M_DEPTH] - 1))  # fewer tokens than the depth: every next token is a node
    length = _longest_match(nodes, corpus, table, meta, pattern, start, stop, min_match)
    while length >= min_match and length > 0:
        cur, chain = _walk(nodes, corpus, table, meta, pattern, stop - length, stop)
        limit = min(max_nodes, int(np.ceil(spec_factor * length + spec_offset)))
        if limit > 0:
            n, score = _grow(nodes, corpus, meta, cur, chain, limit, max_depth, min_prob, out, out_probs, 2)
            if n > 0 and score > best_score + 1e-9:  # ties (up to rounding) go to the longer match
                best_n, best_score, best_len = n, score, length
                out[0, :n] = out[2, :n]
                out[1, :n] = out[3, :n]
                out_probs[0, :n] = out_probs[1, :n]
        length //= 2
    return best_n, best_score, best_len


@njit(nogil=True, cache=True)
def _fits(nodes, corpus, table, meta, num_tokens):
    """Whether ``num_tokens`` more fit without growing (``SuffixIndex.reserve``'s bounds)."""
    new_nodes = meta[M_DEPTH] * num_tokens
    return (meta[M_END] - meta[M_BASE] + num_tokens <= corpus.shape[0]
            and meta[M_USED] + new_nodes <= nodes.shape[0]
            and 2 * (meta[M_TABLE_USED] + new_nodes) <= table.shape[0])


@njit(nogil=True, cache=True)
def _propose(nodes, corpus, table, meta, g_nodes, g_corpus, g_table, g_meta, tokens, new_lo, new_hi, min_match,
             max_nodes, max_depth, min_prob, spec_factor, spec_offset, out, out_probs):
    """A request's step: tokens[new_lo:new_hi] appended to its own index, then the better of the trees its index
    and the global one grow for the context tokens (tokens' suffix). The global one is skipped when empty.
    (-1, 0, 0, 0) without touching anything when the own index has no room for the new tokens (``reserve``)."""
    if not _fits(nodes, corpus, table, meta, new_hi - new_lo):
        return -1, 0.0, 0, 0
    _extend(nodes, corpus, table, meta, tokens, new_lo, new_hi)
    stop = tokens.shape[0]
    n, score, length = _speculate(nodes, corpus, table, meta, tokens, 0, stop, min_match, max_nodes, max_depth,
                                  min_prob, spec_factor, spec_offset, out, out_probs)
    if g_meta[M_END] > g_meta[M_BASE]:
        out[4:6, :n] = out[0:2, :n]  # keep the local tree while the global one grows in out[0:2]
        out_probs[2, :n] = out_probs[0, :n]
        g_n, g_score, g_length = _speculate(g_nodes, g_corpus, g_table, g_meta, tokens, 0, stop, min_match,
                                            max_nodes, max_depth, min_prob, spec_factor, spec_offset, out, out_probs)
        if g_score > score:
            return g_n, g_score, g_length, 1
        out[0:2, :n] = out[4:6, :n]
        out_probs[0, :n] = out_probs[2, :n]
    return n, score, length, 0


@njit(nogil=True, cache=True)
def _count(nodes, corpus, table, meta, pattern):
    """Occurrences of ``pattern`` the index holds (an implicit chain: 1)."""
    if pattern.shape[0] == 0:
        return 0
    cur, chain = _walk(nodes, corpus, table, meta, pattern, 0, pattern.shape[0])
    if cur < 0:
        return 0
    return 1 if chain >= 0 else nodes[cur, COUNT]


# ------------------------------------------------------------------ the index
@dataclass(frozen=True)
class Speculation:
    """A tree as flat arrays: node i's token, parent (-1: the root) and conditional draft probability; the score
    (expected accepted tokens), the match it grew from and whether the global index grew it."""

    tokens: np.ndarray  # [num_nodes] int64
    parents: np.ndarray  # [num_nodes] int64
    probs: np.ndarray  # [num_nodes] float64
    score: float
    match_len: int
    from_global: bool = False


def out_buffers(max_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The arrays a speculation writes its tree into (reused across calls of one caller)."""
    return np.empty((6, max_nodes), np.int64), np.empty((3, max_nodes), np.float64)


class SuffixIndex:
    """The suffix trie of one open sequence and any number of closed ones, within ``max_tokens`` (the oldest
    closed sequences are forgotten first; None: unbounded). Thread-safe: every operation holds the index's
    lock (the compiled code inside runs without the interpreter lock)."""

    def __init__(self, max_depth: int = 24, max_tokens: int | None = None, initial_tokens: int = 256) -> None:
        if not 1 <= max_depth <= 256:
            raise ValueError(f"suffix index depth must be in [1, 256], got {max_depth}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("suffix index max_tokens must be >= 1 (or None: unbounded)")
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        rows = max(64, initial_tokens)
        self.nodes = np.zeros((rows, NODE_COLUMNS), np.int64)
        self.nodes[ROOT, [CHILD, LAST]] = -1
        self.corpus = np.zeros((max(16, initial_tokens), 2), np.int64)
        bits = max(6, int(rows * 2 - 1).bit_length())
        self.table = np.full((1 << bits, 2), EMPTY, np.int64)
        self.meta = np.full(M_OPEN_NODES + max_depth, -1, np.int64)
        self.meta[[M_USED, M_LIVE, M_END, M_BASE, M_TABLE_USED, M_TABLE_BITS, M_DEPTH]] = [1, 1, 0, 0, 0, bits,
                                                                                        max_depth]
        self.closed: deque[tuple[int, int]] = deque()  # (start, end) of the closed sequences, oldest first
        self._first = 0  # the first corpus position held (meta[M_BASE], the position of corpus row 0, is <= it)
        self.lock = threading.Lock()

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.nodes, self.corpus, self.table, self.meta

    # -------------------------------------------------------------- sizes
    @property
    def num_tokens(self) -> int:
        """Tokens held (the open sequence's included)."""
        return int(self.meta[M_END]) - self._first

    @property
    def num_nodes(self) -> int:
        return int(self.meta[M_LIVE])

    @property
    def nbytes(self) -> int:
        """Memory held by the index's arrays."""
        return self.nodes.nbytes + self.corpus.nbytes + self.table.nbytes + self.meta.nbytes

    # -------------------------------------------------------------- updates
    def extend(self, tokens) -> None:
        """Append ``tokens`` to the open sequence (one is opened if none is)."""
        array = _token_array(tokens)
        with self.lock:
            for lo in range(0, array.size, 256):  # capacity reserved per chunk: a long prompt grows it in steps
                hi = min(array.size, lo + 256)
                self.reserve(hi - lo)
                _extend(*self.arrays, array, lo, hi)

    def close(self) -> None:
        """End the open sequence; then forget the oldest sequences beyond ``max_tokens``."""
        with self.lock:
            start = int(self.meta[M_OPEN])
            if start < 0:
                return
            _close(self.corpus, self.meta)
            self.closed.append((start, int(self.meta[M_END])))
            if self.max_tokens is not None:
                while self.closed and self.num_tokens > self.max_tokens:
                    self._evict_oldest()

    def add(self, tokens) -> None:
        """Index ``tokens`` as a closed sequence of their own (the open one, if any, is closed first)."""
        self.close()
        self.extend(tokens)
        self.close()

    def _evict_oldest(self) -> None:
        start, end = self.closed.popleft()
        _evict(*self.arrays, start, end)
        self._first = self.closed[0][0] if self.closed else int(self.meta[M_OPEN]) if self.meta[M_OPEN] >= 0 \
            else int(self.meta[M_END])
        dropped = self._first - int(self.meta[M_BASE])  # corpus rows before the first position held
        if dropped * 2 >= self.corpus.shape[0]:  # shifted once they are half the rows: amortised O(1) per token
            held = int(self.meta[M_END]) - self._first
            self.corpus[:held] = self.corpus[dropped : dropped + held]
            self.meta[M_BASE] = self._first

    # -------------------------------------------------------------- queries
    def speculate(self, pattern, max_nodes: int, max_depth: int, min_prob: float = 0.0, spec_factor: float = 1.0,
                  spec_offset: float = 0.0, min_match: int = 1) -> Speculation:
        """The tree of the most frequent continuations of ``pattern``'s longest match (module docstring)."""
        context = _token_array(pattern[-self.max_depth :])
        out, out_probs = out_buffers(max(1, max_nodes))
        n = length = 0
        score = 0.0
        if max_nodes > 0 and max_depth > 0 and context.size:
            with self.lock:
                n, score, length = _speculate(*self.arrays, context, 0, context.size, min_match, max_nodes,
                                              max_depth, min_prob, spec_factor, spec_offset, out, out_probs)
        return _speculation(out, out_probs, n, score, length, False)

    def count(self, pattern) -> int:
        """Occurrences of ``pattern`` (exact up to the depth; a longer one: 1 if it occurs, else 0)."""
        with self.lock:
            return int(_count(*self.arrays, _token_array(pattern)))

    # -------------------------------------------------------------- capacity
    def reserve(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` more corpus positions and the nodes and map entries they may make (one per
        open suffix each). Call with the lock held."""
        meta = self.meta
        need = int(meta[M_END] - meta[M_BASE]) + num_tokens
        if need > self.corpus.shape[0]:
            grown = np.zeros((max(2 * self.corpus.shape[0], need), 2), np.int64)
            grown[: self.corpus.shape[0]] = self.corpus
            self.corpus = grown
        new_nodes = self.max_depth * num_tokens
        need = int(meta[M_USED]) + new_nodes
        if need > self.nodes.shape[0]:
            grown = np.zeros((max(2 * self.nodes.shape[0], need), NODE_COLUMNS), np.int64)
            grown[: self.nodes.shape[0]] = self.nodes
            self.nodes = grown
        need = 2 * (int(meta[M_TABLE_USED]) + new_nodes)  # at most half full
        if need > self.table.shape[0]:
            live = 2 * (int(meta[M_LIVE]) + new_nodes)  # a rehash drops the tombstones
            self.table = _rehash(self.table, meta, max(int(meta[M_TABLE_BITS]), (live - 1).bit_length()))


def _token_array(tokens) -> np.ndarray:
    array = np.asarray(tokens, np.int64).reshape(-1)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= MAX_TOKEN):
        raise ValueError(f"suffix index token ids must be in [0, {MAX_TOKEN})")
    return array


def propose(local: SuffixIndex, global_index: SuffixIndex | None, tokens, new_lo: int, new_hi: int,
            max_nodes: int, max_depth: int, min_prob: float, spec_factor: float, spec_offset: float,
            buffers: tuple[np.ndarray, np.ndarray]) -> Speculation:
    """One request's step in one compiled call (``_propose``): tokens[new_lo:new_hi] appended to ``local``, then
    the better tree of ``local`` and ``global_index`` for the context ending ``tokens`` (its last depth - 1 tokens
    are matched). ``buffers``: ``out_buffers(max_nodes)``, the caller's. The token ids are the session's, checked
    against the vocabulary by the host (no check here: this is every step's path)."""
    array = np.asarray(tokens, np.int64)
    out, out_probs = buffers
    other = global_index if global_index is not None else _EMPTY
    with local.lock, other.lock:
        while True:  # the bounds are checked in the call (a Python check costs more than the rest of the step)
            n, score, length, from_global = _propose(*local.arrays, *other.arrays, array, new_lo, new_hi, 1,
                                                     max_nodes, max_depth, min_prob, spec_factor, spec_offset, out,
                                                     out_probs)
            if n >= 0:
                break
            local.reserve(new_hi - new_lo)
    return _speculation(out, out_probs, n, score, length, from_global)


def _speculation(out: np.ndarray, out_probs: np.ndarray, n, score, length, from_global) -> Speculation:
    """The tree a compiled speculation wrote into ``out`` / ``out_probs`` (rows 0-1 / 0), copied out of them."""
    return Speculation(out[0, :n].copy(), out[1, :n].copy(), out_probs[0, :n].copy(), float(score), int(length),
                       bool(from_global))


_EMPTY = SuffixIndex(2, None, 16)  # the global index of a proposer without one: holds nothing
_warm_lock = threading.Lock()
_warm = False


def warm_up() -> float:
    """Compile (or load from numba's cache) every compiled function, once per process, by running each operation
    on scratch indexes: a fresh install's first use compiles for ~16 s of one core, then ~50 ms a process loads the
    cache. A suffix proposer calls it when it is built (a drafter replica at start, before it says it is ready), so
    no request waits for the compiler. Returns the seconds it took (0 once warm)."""
    global _warm
    with _warm_lock:
        if _warm:
            return 0.0
        started = time.perf_counter()
        local, bounded = SuffixIndex(4, None, 16), SuffixIndex(4, 24, 16)
        bounded.add([1, 2, 3, 1, 2, 3, 4, 1, 2, 5])
        for start in range(3):  # forgets the oldest sequences: the eviction path, a corpus shift, a rehash
            bounded.add([start + 6, 7, 8, 7, 8, 9, 7, 8])
        propose(local, bounded, [7, 8, 7, 8], 0, 4, 8, 4, 0.0, 2.0, 8.0, out_buffers(8))
        local.speculate([7, 8], 8, 4)
        local.count([7, 8])
        local.close()
        _warm = True
        return time.perf_counter() - started
