"""Lookahead decoding's 2-D Jacobi window, riding along in the verifier's forward pass.

Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding") keeps the last N - 1 Jacobi iterations of a window of W positions as a
2-D window of N - 1 levels x W columns, runs all of it in every forward beside the verified
branch, and collects the n-grams that lie along its columns into a pool; the verification
branch tries the pool's n-grams that start with the newest committed token. Here the window
runs in the verifier (it needs the target's forward) and the n-grams go to the drafter as
``VerifyFeedback.ngrams``: the ``lookahead`` proposer keeps the pool and proposes the verification
branch as its tree (``drafter_service/lookahead.py``); ``retrieval`` can learn from them too.

Layout
------
Let P = prefix_len (the committed tokens in the KV cache); the pending token sits at P. The
window holds ``tokens`` [L, W] with L = N - 1 levels; level l, column i guesses the token at
position P + 1 + i + l. Level 0 is the oldest iteration, level L - 1 the newest. Its rows follow
the tree's in the forward, level-major::

    rows:      [pending, tree nodes..., (0, 0..W-1), (1, 0..W-1), ..., (L-1, 0..W-1)]
    positions: [P,       P + 1 + depth, P + 1 + i + l                                ]
    (l, i) attends to: the committed cache, the pending token, level-0 tokens (0, 0..i-1),
                       and its own column's (0..l, i)   (never to tree nodes; tree nodes never see it)

so the context of (l, i) is the contiguous run of positions P + 1 .. P + 1 + i + l: level 0 up to
column i - 1, then column i's diagonal. As a tree below the pending token this is a comb: level 0
is a chain, and each column's higher levels hang off its level-0 token (``branch_parents``), so
the verifier's tree mask and ``position = prefix_len + depth`` cover it, and the kernel runs it
like any tree. The window rows take no part in acceptance and never stay in the KV cache:
greedy output and the sampling distribution are those of plain verification, and the window
uses no randomness (argmax only).

Harvest
-------
The target's argmax after (L - 1, i), o[i], guesses position P + 1 + i + L. Column i and o[i] are
an n-gram of N consecutive positions: (tokens[0, i], ..., tokens[L - 1, i], o[i]) whose last link
was just predicted from exactly the tokens before it; the links of levels 1.. were predicted in
earlier iterations. A column is harvested when all its levels above 0 were predicted by the target
(``predicted``; a fill is a guess of ours, not the target's); level 0 is the n-gram's key, as in the
paper's pool. The n-grams of one step are deduplicated.

Shift
-----
When a step commits a accepted tokens + the bonus, P moves by a + 1 and the window moves with it,
one iteration on: the new (l, i) sits at P + a + 2 + i + l, where the old (l + 1, i + a) sat, so the
new level l is the old level l + 1 from column a on, and the new top level is o[a:]. With a = 0 this
is plain Jacobi decoding: the window climbs one level per target step. Columns without a source
are filled.

Fills and the initial window
----------------------------
A fill is a bigram prompt lookup: the token after x is the token that followed x most recently in
the committed context (``successors``), or x itself if x never had a successor. Missing level-0
tokens continue the level-0 chain from the pending token; a missing (l, i) continues its column
from (l - 1, i). At prefill the whole window is filled that way (so on repetitive text the first
window already copies the context). The paper fills with random vocabulary tokens; fills from the
context converge faster on code.

N = 2 is one level: W guesses in a chain after the pending token, harvesting bigrams.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LookaheadConfig:
    window: int  # W: columns (positions guessed per level)
    ngram: int  # N >= 2: length of the harvested n-grams; the window has N - 1 levels

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"lookahead window must be a positive integer, got {self.window!r}")
        if not isinstance(self.ngram, int) or self.ngram < 2:
            raise ValueError(f"lookahead n-gram length must be an integer >= 2, got {self.ngram!r}")

    @property
    def levels(self) -> int:
        return self.ngram - 1

    @property
    def rows(self) -> int:
        """Forward rows the whole window adds to a verify step: (N - 1) * W."""
        return self.levels * self.window

    @staticmethod
    def parse(text: str) -> LookaheadConfig:
        """``"W,N"``, e.g. ``"4,3"``."""
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"lookahead must be W,N (window, n-gram length), got {text!r}")
        try:
            window, ngram = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"lookahead must be two integers W,N, got {text!r}") from None
        return LookaheadConfig(window, ngram)

    @staticmethod
    def argument(text: str) -> LookaheadConfig:
        """``parse`` as an argparse ``type``: errors become usage errors."""
        try:
            return LookaheadConfig.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class Window:
    """A session's window: level l, column i guesses position prefix_len + 1 + i + l."""

    tokens: np.ndarray  # [L, W] int64
    predicted: np.ndarray  # [L, W] bool: the target's argmax of an earlier iteration (False: a fill)

    @property
    def levels(self) -> int:
        return int(self.tokens.shape[0])


# ------------------------------------------------------------------ forward
def window_span(prefix_len: int, config: LookaheadConfig, max_positions: int) -> int:
    """Columns that fit: the top of column i sits at prefix_len + i + L < max_positions."""
    return max(0, min(config.window, max_positions - prefix_len - config.levels))


def window_inputs(window: Window, span: int) -> np.ndarray:
    """[L * span] int64: the tokens of columns 0..span-1, level-major (the forward's row order)."""
    return np.ascontiguousarray(window.tokens[:, :span]).reshape(-1)


def branch_parents(tree_parents: np.ndarray, span: int, levels: int = 1) -> list[int]:
    """Parents of the forward's rows [pending, tree nodes..., window rows...] for ``ancestor_mask``.

    tree_parents: [num_nodes] int64 (-1 = child of the pending token). The pending token is the root;
    the window is a comb next to the tree: (0, i) hangs off (0, i - 1) (off the pending token for i = 0)
    and (l, i) off (l - 1, i); (l, i) is row 1 + num_nodes + l * span + i."""
    base = 1 + int(tree_parents.shape[0])
    window = []
    for level in range(levels if span else 0):
        for i in range(span):
            if level:
                window.append(base + (level - 1) * span + i)
            else:
                window.append(base + i - 1 if i else 0)
    return [-1, *(tree_parents + 1).tolist(), *window]


def window_positions(prefix_len: int, span: int, levels: int = 1) -> np.ndarray:
    """[levels * span] int64: (l, i) at prefix_len + 1 + i + l, level-major."""
    return (prefix_len + 1 + np.arange(levels)[:, None] + np.arange(span)[None, :]).reshape(-1).astype(np.int64)


def rows_are_causal(num_nodes: int, tree_is_chain: bool, span: int, levels: int) -> bool:
    """True when [pending, tree, window] is one chain in row order, so plain causal attention is exact."""
    window_is_chain = span == 0 or levels == 1 or span == 1
    return tree_is_chain and window_is_chain and (num_nodes == 0 or span == 0)


# ------------------------------------------------------------------ harvest
def harvest(window: Window, outputs: np.ndarray) -> list[tuple[int, ...]]:
    """N-grams completed by this iteration, first occurrence first, without duplicates.

    outputs: [span] int64, the target's argmax after the top token of columns 0..span-1."""
    span = int(outputs.shape[0])
    assert outputs.ndim == 1 and span <= window.tokens.shape[1], (outputs.shape, window.tokens.shape)
    full = window.predicted[1:, :span].all(axis=0)  # [span]
    grams = np.concatenate([window.tokens[:, :span], outputs[None]], axis=0)[:, full].T  # [num_full, N]
    seen: dict[tuple[int, ...], None] = {}
    for gram in grams.tolist():
        seen.setdefault(tuple(gram), None)
    return list(seen)


# -------------------------------------------------------------------- shift
def shift_window(
    window: Window,
    outputs: np.ndarray,  # [span] int64, argmax after the top token of columns 0..span-1 (span <= W)
    accepted: int,  # draft tokens accepted by the step (the bonus not counted)
    pending: int,  # the new pending token (the bonus), right before the new window
    successors: Mapping[int, int],
) -> Window:
    """The next iteration's window: new (l, i) = old (l + 1, i + accepted), new top level = outputs[accepted:];
    what has no source is filled (``fill_window``)."""
    levels, width = window.tokens.shape
    span = int(outputs.shape[0])
    assert outputs.ndim == 1 and span <= width and accepted >= 0, (outputs.shape, width, accepted)
    tokens = np.zeros((levels, width), np.int64)
    predicted = np.zeros((levels, width), bool)
    known = np.zeros((levels, width), bool)
    moved = max(0, width - accepted)  # old columns accepted.. still ahead of the new pending token
    tokens[:-1, :moved] = window.tokens[1:, accepted : accepted + moved]
    predicted[:-1, :moved] = window.predicted[1:, accepted : accepted + moved]
    known[:-1, :moved] = True
    top = outputs[accepted:]
    tokens[-1, : top.shape[0]] = top
    predicted[-1, : top.shape[0]] = True
    known[-1, : top.shape[0]] = True
    fill_window(tokens, known, pending, successors)
    return Window(tokens, predicted)


def initial_window(first_token: int, config: LookaheadConfig, successors: Mapping[int, int]) -> Window:
    """The window at prefill: all fills after the first generated token."""
    shape = (config.levels, config.window)
    tokens = np.zeros(shape, np.int64)
    fill_window(tokens, np.zeros(shape, bool), first_token, successors)
    return Window(tokens, np.zeros(shape, bool))


# -------------------------------------------------------------------- fills
def fill_window(tokens: np.ndarray, known: np.ndarray, pending: int, successors: Mapping[int, int]) -> None:
    """Fill, in place, the entries of tokens [L, W] not ``known``: (0, i) continues level 0 from the pending
    token, (l, i) continues column i from (l - 1, i), each by the most recent successor."""
    levels, width = tokens.shape
    for level in range(levels):
        for i in range(width):
            if not known[level, i]:
                prev = tokens[level - 1, i] if level else (tokens[0, i - 1] if i else pending)
                tokens[level, i] = successors.get(int(prev), int(prev))


def fill(prev: int, count: int, successors: Mapping[int, int]) -> list[int]:
    """``count`` guesses after token ``prev``: each the most recent successor of the one before
    (a bigram prompt lookup), or that token again when it never had one."""
    out = []
    for _ in range(count):
        prev = successors.get(prev, prev)
        out.append(prev)
    return out


def note_successors(successors: dict[int, int], tokens: Sequence[int]) -> None:
    """Record, in place, that tokens[i + 1] followed tokens[i] (later occurrences win)."""
    for a, b in zip(tokens, tokens[1:], strict=False):
        successors[int(a)] = int(b)
