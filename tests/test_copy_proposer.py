"""Copy proposer: matches and continuations against brute force, the index under rollbacks, the merged
tree within its budget, and a repeated earlier turn copied and accepted by the target."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import (
    VOCAB,
    RecordingVerifier,
    add_cycles,
    check_greedy_steps,
    engine_for,
    greedy,
    tiny_llama,
)

from drafter_service.copy_proposer import (
    WALK_BELOW,
    CopyIndex,
    CopyProposer,
    _match_lengths_walk,
    copy_tree,
    group_continuations,
    match_lengths,
    rank_candidates,
)
from drafter_service.proposer import DraftSessionState, make_proposer
from drafter_service.tree_builders import TreeBuilder
from specmesh.contract import Budget
from specmesh.fast_llama import make_runner
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

SETTINGS = settings(max_examples=300, deadline=None)

# small alphabets so suffixes recur often
token_lists = st.lists(st.integers(0, 2), max_size=30) | st.lists(st.integers(0, 9), max_size=60)


def _state(tokens) -> DraftSessionState:
    return DraftSessionState("s", list(tokens), SamplingParams())


# ------------------------------------------------------------------ brute force
def ref_candidates(tokens: list[int], min_match: int, max_match: int, depth: int) -> list[tuple[int, int, list[int]]]:
    """(match length, position, continuation) of every earlier position, best first: the longest common
    suffix of tokens[:e+1] and tokens, and what follows e when the copy is carried on token by token."""
    n = len(tokens)
    found = []
    for e in range(n - 1):
        length = 0
        while length < max_match and length <= e and tokens[e - length] == tokens[n - 1 - length]:
            length += 1
        if length >= min_match:
            seq = list(tokens)
            for j in range(depth):
                seq.append(seq[e + 1 + j])
            found.append((length, e, seq[n:]))
    return sorted(found, key=lambda c: (-c[0], -c[1]))


def ref_distinct(cands, max_matches: int) -> list[list[int]]:
    out: list[list[int]] = []
    for _, _, cont in cands:
        if cont not in out:
            out.append(cont)
    return out[:max_matches]


def node_path(tree, node: int) -> list[int]:
    return [int(tree.tokens[i]) for i in tree.path_to(node)]


def ref_prob(cands, path: list[int]) -> float:
    """Share of match-length weight agreeing with ``path`` among the candidates agreeing with its parent."""
    agree = sum(c[0] for c in cands if c[2][: len(path)] == path)
    parent = sum(c[0] for c in cands if c[2][: len(path) - 1] == path[:-1])
    return agree / parent


def fresh_index(tokens: list[int], k: int) -> CopyIndex:
    index = CopyIndex(k)
    index.extend(tokens)
    return index


# ------------------------------------------------------------------ properties
@SETTINGS
@given(token_lists, st.integers(1, 3), st.integers(0, 6), st.integers(1, 7), st.integers(1, 5))
def test_matches_and_continuations_equal_brute_force(tokens, min_match, extra, depth, max_matches):
    max_match = min_match + extra
    cands = ref_candidates(tokens, min_match, max_match, depth)
    index = fresh_index(tokens, min_match)
    ends = index.candidates()
    lengths = match_lengths(index.context(), ends, max_match)
    assert sorted(zip(lengths.tolist(), ends.tolist(), strict=True)) == sorted((c[0], c[1]) for c in cands)

    # a budget large enough for every path: the leaves are the distinct continuations, best first
    prop = CopyProposer(min_match, max_match, max_matches)
    tree = prop.propose(_state(tokens), Budget(depth * max_matches, depth))
    tree.validate(10, max_nodes=depth * max_matches, max_depth=depth)
    assert [node_path(tree, leaf) for leaf in tree.leaves] == ref_distinct(cands, max_matches)
    for node in range(tree.num_nodes):
        assert tree.draft_probs[node] == pytest.approx(ref_prob(cands, node_path(tree, node)))
    assert all(s == "copy" for s in tree.sources)


@SETTINGS
@given(token_lists, st.integers(0, 20), st.integers(0, 8), st.integers(1, 8), st.integers(1, 3))
def test_tree_within_budget_shares_prefixes(tokens, max_nodes, max_depth, max_matches, min_match):
    tree = CopyProposer(min_match, 64, max_matches).propose(_state(tokens), Budget(max_nodes, max_depth))
    tree.validate(10, max_nodes=max_nodes, max_depth=max_depth)
    for kids in tree.children:
        toks = [int(tree.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks)), "duplicate siblings"
    if max_nodes == 0 or max_depth == 0:
        assert tree.num_nodes == 0
        return
    want = ref_distinct(ref_candidates(tokens, min_match, 64, max_depth), max_matches)
    paths = [node_path(tree, i) for i in range(tree.num_nodes)]
    # every node is a prefix of a chosen continuation; as much of the best one as fits comes first
    assert all(any(c[: len(p)] == p for c in want) for p in paths)
    assert paths[: min(max_nodes, max_depth)] == [want[0][: d + 1] for d in range(min(max_nodes, max_depth))] if want \
        else not paths
    # nothing left out while nodes remained
    if tree.num_nodes < max_nodes:
        assert all(c[:d] in paths for c in want for d in range(1, len(c) + 1))
    # a node's draft probability is a share: siblings' sum to at most 1
    for kids in tree.children:
        assert sum(tree.draft_probs[k] for k in kids) <= 1 + 1e-9


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(0, 3), max_size=8)), max_size=25),
    st.integers(1, 3),
)
def test_index_stays_consistent_under_appends_and_rollbacks(prompt, edits, min_match):
    """The engine's context edits (drop the last r tokens, append some): the synced index equals one built
    from scratch, and so do the trees."""
    prop = CopyProposer(min_match, 64, 4)
    state = _state(prompt)
    prop.prepare(state)
    for rollback, new in edits:
        rollback = min(rollback, len(state.tokens) - 1)
        if rollback:
            del state.tokens[-rollback:]
        state.tokens.extend(new)
        tree = prop.propose(state, Budget(12, 5))
        index, fresh = state.scratch["copy"], fresh_index(state.tokens, min_match)
        assert index.tokens == fresh.tokens and index.ends == fresh.ends
        assert index.context().tolist() == state.tokens
        again = CopyProposer(min_match, 64, 4).propose(_state(state.tokens), Budget(12, 5))
        assert tree.tokens.tolist() == again.tokens.tolist() and tree.parents.tolist() == again.parents.tolist()
        np.testing.assert_allclose(tree.draft_probs, again.draft_probs)
    # a context replaced wholesale (no common prefix) also resyncs
    state.tokens = [t + 1 for t in state.tokens]
    prop.propose(state, Budget(4, 4))
    assert state.scratch["copy"].ends == fresh_index(state.tokens, min_match).ends
    prop.release(state)
    assert "copy" not in state.scratch


@SETTINGS
@given(st.lists(st.integers(0, 2), min_size=2, max_size=120), st.integers(1, 40))
def test_match_lengths_walk_equals_the_blocked_compare(tokens, max_match):
    """The host walk (few candidates) and the blocked numpy compare (many) give the same lengths; the small
    alphabet makes many candidates and long matches, so the blocks past the first run too."""
    context = np.asarray(tokens, np.int64)
    ends = np.arange(len(tokens) - 1)
    assert ends.size < WALK_BELOW or match_lengths(context, ends, max_match).tolist() == \
        _match_lengths_walk(context, ends, max_match).tolist()
    for few in (ends[:3], ends[-5:], ends[:0]):
        assert _match_lengths_walk(context, few, max_match).tolist() == [
            next((n for n in range(min(max_match, e + 1), 0, -1) if tokens[e - n + 1 : e + 1] == tokens[-n:]), 0)
            for e in few.tolist()]


# ------------------------------------------------------------------ examples
def test_matches_become_a_tree_sharing_prefixes():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 1, 3, 8, 4, 6, 7, 1, 2, 4, 6, 7]
    # suffix (.., 4, 6, 7): at 14 with match 3 (-> 1 2 4 6), at 8 and 2 with match 2 (-> 1 3 8 4, 1 2 9 5)
    tree = make_proposer("copy").propose(_state(tokens), Budget(16, 4))
    assert [node_path(tree, leaf) for leaf in tree.leaves] == [[1, 2, 4, 6], [1, 3, 8, 4], [1, 2, 9, 5]]
    assert tree.children_of(-1) == [0]  # one shared first token
    assert tree.num_nodes == 1 + 3 + 3 + 2
    # draft probabilities: weighted (by match length 3, 2, 2) shares of the candidates
    assert tree.draft_probs[0] == 1.0
    second = {int(tree.tokens[k]): tree.draft_probs[k] for k in tree.children_of(0)}
    assert second == pytest.approx({2: 5 / 7, 3: 2 / 7})
    assert node_path(tree, tree.main_path()[-1]) == [1, 2, 4, 6]  # 3 against 2 below "1 2"
    # the budget cuts the later paths, never the best one
    small = make_proposer("copy").propose(_state(tokens), Budget(5, 4))
    assert [node_path(small, leaf) for leaf in small.leaves] == [[1, 2, 4, 6], [1, 3]]


def test_loop_is_continued_past_the_end_of_the_context():
    tree = make_proposer("copy").propose(_state([9, 4, 1, 2, 3, 1, 2, 3, 1]), Budget(8, 7))
    assert node_path(tree, tree.main_path()[-1]) == [2, 3, 1, 2, 3, 1, 2]


def test_empty_budget_or_no_match_gives_empty_tree():
    prop = make_proposer("copy", min_match=2)
    for tokens, budget in [([1, 2, 1, 2], Budget(8, 0)), ([1, 2, 1, 2], Budget(0, 8)), ([1, 2, 3, 4], Budget(8, 8)),
                           ([7], Budget(8, 8)), ([], Budget(8, 8)), ([1, 2, 3, 1], Budget(8, 8))]:
        assert prop.propose(_state(tokens), budget).num_nodes == 0, tokens
    assert make_proposer("copy", min_match=1).propose(_state([1, 2, 3, 1]), Budget(8, 8)).num_nodes == 8


def test_min_path_prob_stops_weakly_supported_paths():
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 1, 3, 8, 4, 6, 7, 1, 2, 4, 6, 7]
    tree = make_proposer("copy").propose(_state(tokens), Budget(16, 4, min_path_prob=0.5))
    # path shares: 1 -> 1, 1 2 -> 5/7, 1 2 4 -> 3/7, 1 3 -> 2/7, 1 2 9 -> 2/7; a node below 0.5 is
    # kept (the drafters' rule: a path is not extended once below), its subtree is not
    assert [node_path(tree, leaf) for leaf in tree.leaves] == [[1, 2, 4], [1, 3], [1, 2, 9]]


def test_options_are_checked():
    with pytest.raises(ValueError):
        make_proposer("copy", min_match=0)
    with pytest.raises(ValueError):
        make_proposer("copy", min_match=4, max_match=3)
    with pytest.raises(ValueError):
        make_proposer("copy", max_matches=0)


# ------------------------------------------------------------------ with the engine
@torch.no_grad()
def chain_target(seed: int, strength: float = 6.0):
    """A target whose greedy text follows one successor cycle through the whole vocabulary (so an answer
    of up to VOCAB tokens never repeats itself) and whose attention is scaled down: asked the same
    question again, it answers the same way, and only the earlier turn can be copied."""
    model = add_cycles(tiny_llama(seed=seed), seed, strength=0.0)  # only the attention/MLP scaling
    order = list(range(VOCAB))
    random.Random(seed).shuffle(order)
    emb = model.model.embed_tokens.weight
    unit = emb / emb.norm(dim=1, keepdim=True)
    model.lm_head.weight[torch.tensor(order[1:] + order[:1])] += strength * unit[torch.tensor(order)]
    return make_runner(model, "fast")


def test_repeated_turn_is_copied_and_accepted():
    """A chat whose earlier turn (question + the target's answer) is asked again: the copy proposer
    proposes the earlier answer at once, and the target accepts it."""
    target = chain_target(seed=5)
    rng = random.Random(5)
    question = [rng.randrange(VOCAB) for _ in range(30)]
    answer = engine_for(target).generate(question, greedy(40)).token_ids
    assert len(set(answer)) == len(answer)  # no repeats inside the answer: nothing but the turn to copy
    prompt = question + answer + [3, 4] + question
    expected = engine_for(target).generate(prompt, greedy(40)).token_ids
    verifier = RecordingVerifier(target)
    res = engine_for(target, "copy", 16, 8, verifier=verifier).generate(prompt, greedy(40))
    assert res.token_ids == expected
    check_greedy_steps(verifier.log, prompt, expected + [-1] * 10)
    first_tree, first = verifier.log[0]
    assert node_path(first_tree, first_tree.main_path()[-1]) == answer[1:9]  # the copy, proposed whole
    assert expected == answer and first.num_accepted == 8  # ... and accepted whole
    assert res.stats.tau > 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=3, max_size=3), st.integers(1, 8)), min_size=1,
                max_size=80), st.data())
def test_ranking_and_grouping_on_the_host_equal_numpys(rows, data):
    """Below GROUP_ON_HOST_BELOW candidates the copy proposer ranks and groups them in Python: the same order,
    continuations and summed weights as numpy's path, which serves more candidates."""
    import drafter_service.copy_proposer as cp

    conts = np.asarray([r for r, _ in rows], np.int64)
    lengths = np.asarray([n for _, n in rows], np.int64)
    ends = np.asarray(data.draw(st.permutations(range(100)))[: len(rows)], np.int64)
    results = []
    for below in (0, 1 << 30):  # numpy's path, then the host's
        saved, cp.GROUP_ON_HOST_BELOW = cp.GROUP_ON_HOST_BELOW, below
        try:
            order = rank_candidates(ends, lengths)
            results.append((order.tolist(), *(a.tolist() for a in group_continuations(conts[order],
                                                                                      lengths[order].astype(float)))))
        finally:
            cp.GROUP_ON_HOST_BELOW = saved
    assert results[0] == results[1]


def _copy_tree_by_builder(conts, weights, max_paths, budget, source):
    """copy_tree as first written (einsum, then TreeBuilder node by node): the reference for the inlined one."""
    depth = min(budget.max_depth, conts.shape[1])
    paths = conts[:max_paths, :depth]
    agree = np.logical_and.accumulate(conts[None, :, :depth] == paths[:, None, :], axis=2)
    share = np.einsum("pcd,c->pd", agree, weights) / weights.sum()
    builder = TreeBuilder()
    for p, row in enumerate(paths.tolist()):
        node = -1
        for d, tok in enumerate(row):
            child = builder.find(node, tok)
            if child is None:
                if len(builder) >= budget.max_nodes:
                    break
                child = builder.add(node, tok, share[p, d] / (share[p, d - 1] if d else 1.0), source)
            node = child
            if share[p, d] < budget.min_path_prob:
                break
    tree = builder.build()
    return TokenTree(tree.tokens, tree.parents, np.minimum(tree.draft_probs, 1.0), tree.sources)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=6, max_size=6), st.integers(1, 32)), min_size=1,
                max_size=20, unique_by=lambda r: tuple(r[0])),
       st.integers(1, 8), st.integers(0, 24), st.integers(1, 8), st.sampled_from([0.0, 0.05, 0.2, 0.5]))
def test_copy_tree_equals_the_builder_reference(rows, max_paths, max_nodes, max_depth, min_path_prob):
    """The inlined tree building keeps the nodes, parents, draft probabilities and sources of the TreeBuilder
    version (integer-valued weights, as match lengths are: the sums are exact in either order)."""
    conts = np.asarray([r for r, _ in rows], np.int64)
    weights = np.asarray([w for _, w in rows], np.float64)
    budget = Budget(max_nodes, max_depth, None, min_path_prob)
    got = copy_tree(conts, weights, max_paths, budget, "copy")
    want = _copy_tree_by_builder(conts, weights, max_paths, budget, "copy")
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    assert got.draft_probs.tolist() == want.draft_probs.tolist() and got.sources == want.sources
