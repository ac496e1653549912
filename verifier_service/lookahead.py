"""A Jacobi window that rides along in the verifier's forward pass (lookahead decoding, one level).

Per session the verifier keeps W guess tokens for the positions right after the pending
token. Let P = prefix_len (the committed tokens in the KV cache); the pending token sits at
P and window token j at P + 1 + j. Each verify appends the window to the forward input as
one more chain branch hanging off the pending token::

    rows:       [pending, tree nodes..., window tokens...]
    positions:  [P,       P + 1 + depth, P + 1 + j       ]
    window j attends to: the committed cache, the pending token, window tokens 0..j
                         (never to tree nodes; tree nodes never see window tokens)

so the target's argmax after window token j is one Jacobi iteration's new guess for
position P + 2 + j. The window rows take no part in acceptance and never stay in the KV
cache: greedy output and the sampling distribution are those of plain verification, and
the window uses no randomness (argmax only).

Trajectory and harvest
----------------------
Iteration t is the window fed in verify t. The n-grams of Jacobi decoding lie on the
diagonals of the trajectory: the token at position p in iteration t, the one at p + 1 in
iteration t + 1, ..., p + N - 1 in iteration t + N - 1, each predicted by the target right
after its diagonal predecessor (which was the last input of that prediction). We store the
trajectory by diagonals: ``trail`` [N - 1, W], column j is the diagonal that ends at window
token j, i.e. ``trail[-1 - d, j]`` is the token at absolute position P + 1 + j - d in
iteration t - d (-1 where the diagonal is broken: a fill token starts a new diagonal, as
it was not predicted after anything). This is the last N - 1 iterations of the window keyed
by absolute position, restricted to what can still extend into an n-gram. After verify t
with outputs o[j] (argmax after window token j), every column j whose N - 1 entries are all
known gives the n-gram (*trail[:, j], o[j]); the n-grams of one step are deduplicated.

Shift
-----
When a step commits a accepted tokens + the bonus, P moves by a + 1 and the window moves
with it: new window token i (position P' + 1 + i, P' = P + a + 1) takes o[a + i], the
previous iteration's guess for that position, and its diagonal (``trail[1:, a + i]``) moves
along. With a = 0 every position keeps a guess: that is plain Jacobi decoding, one position
per target step. The last min(a, W) positions have no guess; they are filled (below).

Fills and the initial window
----------------------------
A fill continues the window with a bigram prompt lookup: the token after x is the token
that followed x most recently in the committed context (``successors``), or x itself if x
never had a successor. At prefill the whole window is such a chain from the first token
(so on repetitive text the first window already copies the context). Fills start new
diagonals.

How this differs from lookahead decoding (Fu et al., 2024)
----------------------------------------------------------
Lookahead decoding runs a 2-D window: the last N - 1 iterations all sit in the forward
pass as N - 1 levels of W tokens, and each token of the newest level attends to its whole
diagonal (its predecessors in the older levels), so the n-gram a prediction completes is
also its context. Here only the newest level runs (W rows per verify instead of
(N - 1) * W); each window token attends to the window tokens before it in *its own*
iteration, and the older levels live only in the verifier's session state, as the n-grams'
leading tokens. The harvested n-grams therefore follow the same diagonals but each link
was predicted from the current row's context, not from the diagonal; and the window
advances with verification (by a + 1 positions per step, the committed tokens replacing
guesses) instead of by one position per iteration. Lookahead decoding's verification branch
is replaced by the drafter's own tree: the n-grams go to the drafter (``VerifyFeedback``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

NO_TOKEN = -1  # a broken diagonal in ``trail``


@dataclass(frozen=True)
class LookaheadConfig:
    window: int  # W: guess tokens per verify (extra forward rows)
    ngram: int  # N >= 2: length of the harvested n-grams

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"lookahead window must be a positive integer, got {self.window!r}")
        if not isinstance(self.ngram, int) or self.ngram < 2:
            raise ValueError(f"lookahead n-gram length must be an integer >= 2, got {self.ngram!r}")

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
        import argparse

        try:
            return LookaheadConfig.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


# ------------------------------------------------------------------ forward
def window_span(prefix_len: int, window: int, max_positions: int) -> int:
    """How many window tokens fit: window token j sits at prefix_len + 1 + j < max_positions."""
    return max(0, min(window, max_positions - 1 - prefix_len))


def branch_parents(tree_parents: np.ndarray, span: int) -> list[int]:
    """Parents of the forward's rows [pending, tree nodes..., window tokens...] for ``ancestor_mask``.

    tree_parents: [num_nodes] int64 (-1 = child of the pending token). The pending token is the root;
    the window is a chain below it, next to the tree: window token 0 hangs off row 0, token j off the
    row of token j - 1."""
    num_nodes = int(tree_parents.shape[0])
    window = [0] + list(range(num_nodes + 1, num_nodes + span))  # token j sits in row 1 + num_nodes + j
    return [-1, *(tree_parents + 1).tolist(), *window[:span]]


def window_positions(prefix_len: int, span: int) -> np.ndarray:
    """[span] int64: window token j at prefix_len + 1 + j."""
    return prefix_len + 1 + np.arange(span, dtype=np.int64)


# ------------------------------------------------------------------ harvest
def harvest(trail: np.ndarray, outputs: np.ndarray) -> list[tuple[int, ...]]:
    """N-grams completed by this iteration, first occurrence first, without duplicates.

    trail: [N - 1, span] int64, the diagonals of the window tokens fed (NO_TOKEN = broken);
    outputs: [span] int64, the target's argmax after each window token."""
    assert trail.ndim == 2 and outputs.shape == (trail.shape[1],), (trail.shape, outputs.shape)
    full = (trail != NO_TOKEN).all(axis=0)  # [span]
    grams = np.concatenate([trail, outputs[None]], axis=0)[:, full].T  # [num_full, N]
    seen: dict[tuple[int, ...], None] = {}
    for gram in grams.tolist():
        seen.setdefault(tuple(gram), None)
    return list(seen)


# -------------------------------------------------------------------- shift
def shift_trail(
    trail: np.ndarray,  # [N - 1, W] int64, the diagonals of the window just fed
    outputs: np.ndarray,  # [span] int64, argmax after window tokens 0..span-1 (span <= W)
    advance: int,  # positions the window start moves: accepted tokens + 1 (the bonus)
    pending: int,  # the new pending token (the bonus), just before the new window
    successors: Mapping[int, int],
) -> np.ndarray:
    """The next iteration's window: [N - 1, W]. New token i is the old output for its position,
    ``outputs[advance - 1 + i]``, with its diagonal; positions without one are filled (``fill``)."""
    assert trail.ndim == 2 and outputs.ndim == 1 and outputs.shape[0] <= trail.shape[1], (trail.shape, outputs.shape)
    assert advance >= 1, advance
    levels, width = trail.shape
    kept = outputs[advance - 1 :][:width]  # [num_kept]
    num_kept = kept.shape[0]
    new = np.full((levels, width), NO_TOKEN, np.int64)
    new[:-1, :num_kept] = trail[1:, advance - 1 : advance - 1 + num_kept]
    new[-1, :num_kept] = kept
    if num_kept < width:
        last = int(kept[-1]) if num_kept else pending
        new[-1, num_kept:] = fill(last, width - num_kept, successors)
    return new


def initial_trail(first_token: int, config: LookaheadConfig, successors: Mapping[int, int]) -> np.ndarray:
    """[N - 1, W] int64: the window at prefill, a fill chain after the first generated token."""
    trail = np.full((config.ngram - 1, config.window), NO_TOKEN, np.int64)
    trail[-1] = fill(first_token, config.window, successors)
    return trail


# -------------------------------------------------------------------- fills
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
