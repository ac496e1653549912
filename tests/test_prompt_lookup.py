"""Prompt lookup: n-gram continuations against brute force; the merged tree within its budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.prompt_lookup import PromptLookupProposer, continuations_tree, ngram_continuations
from drafter_service.proposer import DraftSessionState, make_proposer
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams

SETTINGS = settings(max_examples=300, deadline=None)

# small alphabets so suffixes recur often
token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=40) | st.lists(st.integers(0, 9), max_size=60)


def ref_continuations(tokens: list[int], min_ngram: int, max_ngram: int, max_len: int, max_matches: int):
    """Longest n first, most recent occurrence first, each occurrence strictly before the suffix itself."""
    n_tok = len(tokens)
    out: list[list[int]] = []
    for n in range(max_ngram, min_ngram - 1, -1):
        if n < 1 or n >= n_tok:
            continue
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + max_len]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) >= max_matches:
                        return out
    return out


@SETTINGS
@given(
    token_lists,
    st.integers(1, 3),
    st.integers(0, 4),
    st.integers(1, 8),
    st.integers(1, 6),
)
def test_ngram_continuations_match_brute_force(tokens, min_ngram, extra, max_len, max_matches):
    max_ngram = min_ngram + extra
    got = ngram_continuations(np.asarray(tokens, np.int64), min_ngram, max_ngram, max_len, max_matches)
    want = ref_continuations(tokens, min_ngram, max_ngram, max_len, max_matches)
    assert [c.tolist() for c in got] == want
    for c in got:
        assert 1 <= c.size <= max_len


@SETTINGS
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=10), max_size=8),
    st.integers(0, 20),
    st.integers(0, 10),
)
def test_continuations_tree_respects_budget_and_shares_prefixes(conts, max_nodes, max_depth):
    budget = Budget(max_nodes, max_depth)
    tree = continuations_tree([np.asarray(c, np.int64) for c in conts], budget, "pl")
    tree.validate(5, max_nodes=max_nodes, max_depth=max_depth)
    assert all(s == "pl" for s in tree.sources)
    paths = {tuple(int(tree.tokens[i]) for i in tree.path_to(n)) for n in range(tree.num_nodes)}
    truncated = [tuple(c[:max_depth]) for c in conts]
    # every node is a prefix of some continuation, once (shared prefixes merged)
    assert len(paths) == tree.num_nodes
    assert all(any(t[: len(p)] == p for t in truncated) for p in paths)
    # nothing left out while budget remained: if the tree is not full, every truncated continuation is in it
    if tree.num_nodes < max_nodes:
        assert all(t[:k] in paths for t in truncated for k in range(1, len(t) + 1))
    # the best continuation comes first: as much of it as fits is in the tree
    if conts and max_nodes and max_depth:
        first = truncated[0]
        assert first[: min(len(first), max_nodes)] in paths


def _state(tokens):
    return DraftSessionState("s", list(tokens), SamplingParams())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 3), max_size=12)), min_size=1, max_size=8),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 6), st.integers(1, 6))
def test_the_indexed_proposer_finds_what_the_reference_finds_across_edits(edits, min_ngram, extra, max_len,
                                                                          max_matches):
    """The proposer's per-session index, synced across edits of the context's end (a rollback of r tokens, then
    appends, as drafted-ahead hypotheses and commits make them), proposes from the continuations that
    ``ngram_continuations`` finds on the whole context, in the same order."""
    prop = PromptLookupProposer(min_ngram=min_ngram, max_ngram=min_ngram + extra, max_matches=max_matches)
    state = _state([])
    for rollback, appended in edits:
        del state.tokens[max(0, len(state.tokens) - rollback):]
        state.tokens += appended
        want = ngram_continuations(np.asarray(state.tokens, np.int64), min_ngram, min_ngram + extra, max_len,
                                   max_matches)
        budget = Budget(64, max_len)
        got, ref = prop.propose(state, budget), continuations_tree(want, budget, prop.name)
        assert (got.tokens.tolist(), got.parents.tolist()) == (ref.tokens.tolist(), ref.parents.tolist())


def test_bad_ngram_options_are_refused():
    for options in (dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_matches=0)):
        with pytest.raises(ValueError, match="min_ngram"):
            PromptLookupProposer(**options)


def test_proposer_chain_follows_most_recent_longest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    tree = make_proposer("prompt_lookup").propose(_state(tokens), Budget(8, 3))
    # suffix (5, 6, 7) occurred at 5 (-> 1 2 5) and at 0 (-> 8 9 5); the most recent wins
    assert tree.tokens.tolist() == [1, 2, 5] and tree.parents.tolist() == [-1, 0, 1]
    tree = make_proposer("prompt_lookup_tree").propose(_state(tokens), Budget(8, 3))
    assert tree.tokens.tolist()[:3] == [1, 2, 5]
    assert {tuple(int(tree.tokens[i]) for i in p) for p in tree.paths()} >= {(1, 2, 5), (8, 9, 5)}


def test_proposer_empty_budget_or_no_match_gives_empty_tree():
    assert make_proposer("prompt_lookup").propose(_state([1, 2, 3]), Budget(8, 0)).num_nodes == 0
    assert make_proposer("prompt_lookup").propose(_state([1, 2, 3]), Budget(0, 8)).num_nodes == 0
    assert make_proposer("prompt_lookup").propose(_state([1, 2, 3, 4]), Budget(8, 8)).num_nodes == 0
    assert make_proposer("prompt_lookup").propose(_state([7]), Budget(8, 8)).num_nodes == 0


@settings(max_examples=100, deadline=None)
@given(token_lists, st.integers(1, 16), st.integers(1, 8), st.integers(1, 4))
def test_proposer_tree_within_budget(tokens, max_nodes, max_depth, max_ngram):
    prop = PromptLookupProposer(min_ngram=1, max_ngram=max_ngram, max_matches=8, name="plt")
    tree = prop.propose(_state(tokens), Budget(max_nodes, max_depth))
    tree.validate(10, max_nodes=max_nodes, max_depth=max_depth)
    want = ref_continuations(tokens, 1, max_ngram, max_depth, 8)
    if want:  # the top continuation's first token is always proposed
        assert tree.num_nodes >= 1 and int(tree.tokens[0]) == want[0][0]
    else:
        assert tree.num_nodes == 0
