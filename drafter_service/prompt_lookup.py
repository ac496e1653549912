"""Prompt lookup: continue the context's suffix the way it continued earlier in the context.

The longest suffix n-gram (max_ngram down to min_ngram) that occurred before is
looked up; what followed each occurrence (most recent first) becomes a path of
the tree. One match gives a chain; several distinct continuations give a tree
that shares common prefixes. Deterministic, so nodes carry point-mass draft
distributions (lossless under sampling too).

The proposer keeps a per-session index of the context (``copy_proposer.CopyIndex``: every position by the
``min_ngram``-gram ending there, synced with the context's edits in O(edit)), so a proposal measures only the
positions whose last ``min_ngram`` tokens equal the suffix's (``indexed_continuations``) instead of comparing
every window of the context for every n (``ngram_continuations``, the reference: the same continuations in the
same order).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from drafter_service.copy_proposer import CopyIndex, match_lengths, rank_candidates
from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from drafter_service.tree_builders import TreeBuilder
from specmesh.contract import Budget
from specmesh.tree import TokenTree


def ngram_continuations(
    tokens: np.ndarray,  # [num_tokens] int64, the committed context
    min_ngram: int,
    max_ngram: int,
    max_len: int,
    max_matches: int,
) -> list[np.ndarray]:
    """Continuations of earlier occurrences of the context's suffix, best first.

    Longer matched n-grams come first; within one n, the most recent occurrence first.
    Duplicate continuations are dropped. Each continuation has 1..max_len tokens.
    """
    num_tokens = tokens.shape[0]

    def firsts() -> Iterator[int]:  # where each occurrence's continuation starts, best first (lazily, per n)
        for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
            suffix = tokens[num_tokens - n :]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]
            for start in np.flatnonzero((windows == suffix).all(axis=1))[::-1].tolist():
                yield start + n

    return _distinct_continuations(tokens, firsts(), max_len, max_matches)


def indexed_continuations(
    context: np.ndarray,  # [num_tokens] int64, the committed context
    ends: np.ndarray,  # [num_candidates] int64: positions < num_tokens - 1 whose min_ngram-gram is the suffix's
    max_ngram: int,
    max_len: int,
    max_matches: int,
) -> list[np.ndarray]:
    """``ngram_continuations`` from an index's candidates: a candidate e is an occurrence of the suffix n-gram for
    every n up to its match length, so "longest n first, most recent first, duplicates dropped" is the
    candidates ranked by (match length capped at max_ngram, e), descending, and the first of each continuation."""
    if ends.size == 0:
        return []
    lengths = match_lengths(context, ends, max_ngram)  # [num_candidates], each >= min_ngram
    return _distinct_continuations(context, (ends[rank_candidates(ends, lengths)] + 1).tolist(), max_len, max_matches)


def _distinct_continuations(context: np.ndarray, firsts: Iterable[int], max_len: int,
                           max_matches: int) -> list[np.ndarray]:
    """``context[f : f + max_len]`` for each f of ``firsts`` in order, empty and repeated ones dropped, until
    ``max_matches`` are found (``firsts`` is read no further)."""
    found: list[np.ndarray] = []
    seen: set[bytes] = set()
    for first in firsts:
        cont = context[first : first + max_len]
        key = cont.tobytes()
        if cont.size == 0 or key in seen:
            continue
        seen.add(key)
        found.append(cont)
        if len(found) >= max_matches:
            break
    return found


def continuations_tree(continuations: list[np.ndarray], budget: Budget, source: str) -> TokenTree:
    """Merge continuations (best first) into one tree within the budget."""
    builder = TreeBuilder()
    for cont in continuations:
        if len(builder) >= budget.max_nodes:
            break
        builder.add_path(cont[: budget.max_depth].tolist(), source, max_nodes=budget.max_nodes)
    return builder.build()


@dataclass
class PromptLookupProposer(Proposer):
    min_ngram: int = 1
    max_ngram: int = 4
    max_matches: int = 1  # 1 = chain; more = multi-match tree
    name: str = "prompt_lookup"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or self.max_matches < 1:
            raise ValueError(f"{self.name} needs 1 <= min_ngram <= max_ngram and max_matches >= 1, got "
                             f"{self.min_ngram}, {self.max_ngram} and {self.max_matches}")

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        index: CopyIndex = self.scratch(state)
        index.sync(state.tokens)
        conts = indexed_continuations(index.context(), index.candidates(), self.max_ngram, budget.max_depth,
                                      self.max_matches)
        return continuations_tree(conts, budget, self.name)

    def prepare(self, state: DraftSessionState) -> None:
        """Index the prompt."""
        index = state.scratch[self.name] = CopyIndex(self.min_ngram)
        index.sync(state.tokens)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)


def chain_proposer(**given) -> PromptLookupProposer:
    opts = proposer_options(given, ("min_ngram", "max_ngram"), "prompt_lookup")
    return PromptLookupProposer(max_matches=1, **{k: int(v) for k, v in opts.items()})


def tree_proposer(**given) -> PromptLookupProposer:
    opts = {k: int(v) for k, v in proposer_options(given, ("min_ngram", "max_ngram", "max_matches"),
                                                   "prompt_lookup_tree").items()}
    return PromptLookupProposer(max_matches=opts.pop("max_matches", 8), name="prompt_lookup_tree", **opts)
