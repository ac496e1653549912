"""Tree fusion: merging member trees within the budget, and the per-proposer calibration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.fusion import (
    AcceptanceCalibration,
    FusedProposer,
    fuse_trees,
    fused_proposer,
    member_options,
    parse_members,
    tree_outcomes,
)
from drafter_service.proposer import DraftSessionState, Proposer
from drafter_service.tree_builders import TreeBuilder, best_paths_tree
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree


def _tree(paths: list[list[int]], source: str, prob: float = 0.5) -> TokenTree:
    b = TreeBuilder()
    for path in paths:
        node = -1
        for tok in path:
            node = b.find(node, tok) if b.find(node, tok) is not None else b.add(node, tok, prob, source)
    return b.build()


def _paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every node's token path from the root."""
    return {tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(tree.num_nodes)}


paths_st = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=0, max_size=5)


@settings(max_examples=200, deadline=None)
@given(paths_st, paths_st, st.integers(0, 12), st.integers(0, 6),
       st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_fused_tree_keeps_the_best_scored_nodes_of_the_union(a, b, max_nodes, max_depth, pa, pb):
    ta, tb = _tree(a, "a", pa), _tree(b, "b", pb)
    fused = fuse_trees([ta, tb], AcceptanceCalibration(), Budget(max_nodes, max_depth))
    union = {p for p in _paths(ta) | _paths(tb) if len(p) <= max_depth}
    got = _paths(fused)
    assert fused.num_nodes == len(got) == min(max_nodes if max_depth else 0, len(union))  # shared prefixes merged
    assert got <= union
    for kids in fused.children:
        toks = [int(fused.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))

    def score(path):  # product of noisy-or estimates along the path
        s = 1.0
        for d in range(1, len(path) + 1):
            miss = (1 - pa if path[:d] in _paths(ta) else 1.0) * (1 - pb if path[:d] in _paths(tb) else 1.0)
            s *= 1 - miss
        return s

    if got and union - got:
        assert min(score(p) for p in got) >= max(score(p) for p in union - got) - 1e-12


def _fuse_by_paths(trees, calibration, budget, min_score=0.0):
    """fuse_trees as it was first written (path tuples, one estimate at a time, ``best_paths_tree``): the
    reference the trie version must equal node for node."""
    if budget.is_zero:
        return TokenTree.empty()
    miss, best = {}, {}
    for tree in trees:
        keys = []
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
    score = {}
    for key in sorted(miss, key=len):
        score[key] = (score[key[:-1]] if len(key) > 1 else 1.0) * (1.0 - miss[key])
    scored = {key: (score[key], max(1e-6, 1.0 - m), best[key][1]) for key, m in miss.items()}
    return best_paths_tree(scored, budget.max_nodes, max(min_score, budget.min_path_prob))


member_st = st.tuples(paths_st, st.sampled_from(["a", "b", "c"]), st.floats(0.0, 1.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(member_st, max_size=4), st.integers(0, 12), st.integers(0, 6), st.floats(0.0, 0.5),
       st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0.0, 1.0), st.booleans()), max_size=30),
       st.booleans())
def test_fused_tree_equals_the_path_reference(members, max_nodes, max_depth, min_score, evidence, mixed):
    """The trie version of fuse_trees keeps the nodes, order, draft probabilities and sources the path version
    kept, with a calibration that has seen evidence, members of several sources, and a member tree whose nodes
    name different sources."""
    cal = AcceptanceCalibration()
    for source, prob, ok in evidence:
        cal.observe(source, prob, ok)
    trees = [_tree(paths, source, prob) for paths, source, prob in members]
    if mixed and trees and trees[0].num_nodes:
        t = trees[0]
        trees[0] = TokenTree(t.tokens, t.parents, t.draft_probs, tuple("ab"[i % 2] for i in range(t.num_nodes)))
    budget = Budget(max_nodes, max_depth)
    got, want = fuse_trees(trees, cal, budget, min_score), _fuse_by_paths(trees, cal, budget, min_score)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert got.draft_probs.tolist() == want.draft_probs.tolist()
    assert got.sources == want.sources


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), max_size=40), st.floats(0.9, 1.0))
def test_observing_many_at_once_equals_one_at_a_time(outcomes, decay):
    one, many = AcceptanceCalibration(decay=decay), AcceptanceCalibration(decay=decay)
    one.observe("x", 0.5, True)
    many.observe("x", 0.5, True)
    for prob, ok in outcomes:
        one.observe("x", prob, ok)
    many.observe_many("x", [p for p, _ in outcomes], [ok for _, ok in outcomes])
    for (h1, t1), (h2, t2) in zip(one.table()["x"], many.table()["x"], strict=True):
        assert t1 == pytest.approx(t2, rel=1e-12, abs=1e-12)
        assert h1 == pytest.approx(h2, rel=1e-9, abs=1e-12) or (np.isnan(h1) and np.isnan(h2))
    probs = np.linspace(0, 1, 11)
    assert many.estimates(["x"] * 11, probs).tolist() == pytest.approx([many.estimate("x", p) for p in probs])
    assert many.estimates((), probs).tolist() == [many.estimate("", p) for p in probs]


def test_agreement_between_members_ranks_first():
    fused = fuse_trees([_tree([[1, 2]], "a"), _tree([[3], [1, 2]], "b")], AcceptanceCalibration(), Budget(2, 2))
    assert _paths(fused) == {(1,), (1, 2)}
    assert fused.draft_probs[0] == pytest.approx(0.75)  # 1 - 0.5 * 0.5


def test_tree_outcomes_judge_only_nodes_whose_parent_was_accepted():
    tree = _tree([[1, 2, 3], [1, 4], [5]], "a")
    outcomes = {tuple(int(tree.tokens[j]) for j in tree.path_to(n)): ok for n, ok in tree_outcomes(tree, [1, 4, 9])}
    assert outcomes == {(1,): True, (5,): False, (1, 2): False, (1, 4): True}
    assert tree_outcomes(tree, []) == []


def test_calibration_moves_from_the_claim_to_the_evidence():
    cal = AcceptanceCalibration(prior_weight=4.0, decay=1.0)
    assert cal.estimate("x", 0.9) == pytest.approx(0.9)
    for _ in range(200):
        cal.observe("x", 0.9, False)
    assert cal.estimate("x", 0.9) < 0.05
    assert cal.estimate("y", 0.9) == pytest.approx(0.9)  # per source


class _Fixed(Proposer):
    """A member that always proposes the same paths."""

    def __init__(self, name: str, paths: list[list[int]], prob: float) -> None:
        self.name, self.paths, self.prob = name, paths, prob

    def propose(self, state, budget):
        return _tree(self.paths, self.name, self.prob)


def test_live_calibration_learns_which_member_to_trust():
    """'liar' claims 0.95 and is always wrong; 'honest' claims 0.3 and is always right: after a few
    judged steps the fused tree puts the honest member's token first."""
    prop = FusedProposer([_Fixed("liar", [[7]], 0.95), _Fixed("honest", [[3]], 0.3)])
    state = DraftSessionState("s", [1, 2], SamplingParams())
    prop.prepare(state)
    first = prop.propose(state, Budget(1, 1))
    assert first.tokens.tolist() == [7]
    for _ in range(30):
        state.tokens += [3]  # the target continued with 3
        state.committed_len = len(state.tokens)  # as LocalDrafter records it from the feedback
        prop.observe(state, DraftFeedback(len(state.tokens)))
        tree = prop.propose(state, Budget(1, 1))
    assert tree.tokens.tolist() == [3] and tree.sources == ("honest",)
    table = prop.calibration.table()
    assert table["liar"][4][0] == 0.0 and table["honest"][1][0] == 1.0


def test_trees_drafted_on_a_taken_back_hypothesis_are_not_judged():
    prop = FusedProposer([_Fixed("a", [[9]], 0.5)])
    state = DraftSessionState("s", [1, 2], SamplingParams())
    prop.prepare(state)
    state.committed_len = 2
    state.tokens += [5, 5]  # a hypothesis
    prop.propose(state, Budget(1, 1))
    state.tokens[2:] = [6, 5, 7]  # taken back: 6 5 7 committed instead (the last token still agrees)
    state.committed_len = len(state.tokens)
    prop.observe(state, DraftFeedback(len(state.tokens)))
    assert prop.calibration.table() == {}


def test_parse_members():
    assert parse_members("copy+retrieval") == ["copy", "retrieval"]
    assert parse_members(["a", "b"]) == ["a", "b"]
    for bad in ("", "a+a", "fused+copy"):
        with pytest.raises(ValueError):
            parse_members(bad)


def test_members_take_their_own_options():
    prop = fused_proposer("copy+prompt_lookup_tree", **{"copy.max_matches": 2, "copy.min_match": 2})
    copy = prop.members[0]
    assert (copy.max_matches, copy.min_match) == (2, 2)
    assert member_options(["copy", "retrieval"], {"copy.max_match": 4, "store": None}) == {
        "copy": {"max_match": 4}, "retrieval": {}}
    with pytest.raises(ValueError, match="names no member"):
        fused_proposer("copy+recycling", **{"falcon.head": "/x"})
    with pytest.raises(ValueError, match="copy has no option"):
        fused_proposer("copy", **{"copy.nope": 1})
    assert not prop.feedback_features


def test_sampled_members_lose_their_distributions():
    q = TokenTree(np.array([4]), np.array([-1]), np.array([0.5]), ("m",), np.array([0, 2]), np.array([4, 5]),
                  np.array([0.5, 0.5]))
    fused = fuse_trees([q], AcceptanceCalibration(), Budget(4, 4))
    assert not fused.has_draft_dists and fused.tokens.tolist() == [4]  # verified with the point-mass rule
