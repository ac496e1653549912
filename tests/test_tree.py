"""TokenTree: derived fields against brute force on random trees; validation."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmesh import tree as tree_module
from specmesh.tree import HOST_CHECK_BELOW, InvalidTreeError, TokenTree

VOCAB = 50
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trees(draw, max_nodes: int = 24, with_dists: bool = False):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    probs = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    tree = TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(probs, np.float64),
                     tuple(f"s{i % 3}" for i in range(n)))
    if not with_dists:
        return tree
    return with_random_dists(tree, draw(st.integers(0, 2**31)))


def with_random_dists(tree: TokenTree, seed: int) -> TokenTree:
    """Attach a valid sparse draft distribution to every node (its token included, sums to 1)."""
    rng = np.random.default_rng(seed)
    ids, vals, cu = [], [], [0]
    for i in range(tree.num_nodes):
        others = rng.choice([t for t in range(VOCAB) if t != tree.tokens[i]], size=rng.integers(0, 4), replace=False)
        node_ids = np.concatenate([[tree.tokens[i]], others]).astype(np.int64)
        rng.shuffle(node_ids)
        w = rng.dirichlet(np.ones(node_ids.size))
        ids.append(node_ids)
        vals.append(w)
        cu.append(cu[-1] + node_ids.size)
    return TokenTree(
        tree.tokens, tree.parents, tree.draft_probs, tree.sources,
        q_cu=np.asarray(cu, np.int64),
        q_ids=np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64),
        q_probs=np.concatenate(vals) if vals else np.zeros(0),
    )


# ------------------------------------------------------------ brute force
def ref_ancestors(parents: list[int], i: int) -> list[int]:
    """i's ancestors (excluding i), nearest first, by walking parent links."""
    out = []
    p = parents[i]
    while p != -1:
        out.append(p)
        p = parents[p]
    return out


@SETTINGS
@given(trees())
def test_derived_fields_match_brute_force(tree: TokenTree):
    parents = tree.parents.tolist()
    n = len(parents)
    tree.validate(VOCAB)
    for i in range(n):
        anc = ref_ancestors(parents, i)
        assert tree.depth[i] == len(anc)
        assert tree.ancestor_mask[i].tolist() == [j == i or j in anc for j in range(n)]
        assert tree.path_to(i) == anc[::-1] + [i]
        assert tree.children_of(i) == [j for j in range(n) if parents[j] == i]
    assert tree.children_of(-1) == [j for j in range(n) if parents[j] == -1]
    for prefix_len in (0, 7):
        assert tree.position_ids(prefix_len).tolist() == [prefix_len + len(ref_ancestors(parents, i)) for i in range(n)]
    leaves = [i for i in range(n) if i not in parents]
    assert tree.leaves == leaves
    assert tree.paths() == [ref_ancestors(parents, leaf)[::-1] + [leaf] for leaf in leaves]
    assert tree.max_depth == (max(len(ref_ancestors(parents, i)) for i in range(n)) + 1 if n else 0)
    # every node lies on exactly the paths through it; paths are distinct and cover every node
    assert sorted({j for path in tree.paths() for j in path}) == list(range(n))


@SETTINGS
@given(trees(with_dists=True))
def test_valid_trees_with_distributions_pass_and_dists_round_trip(tree: TokenTree):
    assert tree.validate(VOCAB, max_nodes=tree.num_nodes, max_depth=tree.max_depth) is tree
    for i in range(tree.num_nodes):
        ids, probs = tree.draft_dist(i)
        assert probs.sum() == pytest.approx(1.0)
        assert probs[ids == tree.tokens[i]].size == 1


def test_point_mass_when_no_distributions():
    tree = TokenTree.chain([5, 6, 7])
    ids, probs = tree.draft_dist(1)
    assert ids.tolist() == [6] and probs.tolist() == [1.0]
    assert tree.parents.tolist() == [-1, 0, 1] and tree.max_depth == 3


# ------------------------------------------------ PEARL operations: main line, subtree, head
@SETTINGS
@given(trees())
def test_main_path_follows_the_most_likely_child_to_a_leaf(tree: TokenTree):
    """From the root, each step takes the child of highest draft probability (the first of equals),
    down to a leaf."""
    path = tree.main_path()
    parent = -1
    for node in path:
        kids = tree.children_of(parent)
        best = max(tree.draft_probs[k] for k in kids)
        assert node == next(k for k in kids if tree.draft_probs[k] == best)
        parent = node
    assert not tree.children_of(parent)  # it ends at a leaf (or the root of an empty tree)
    assert path == (tree.path_to(path[-1]) if path else [])


@SETTINGS
@given(trees())
def test_path_ranks_order_nodes_by_path_probability(tree: TokenTree):
    """Rank = place in the order of (path probability descending, depth, index); a child never ranks above
    its parent; a chain's ranks are its indices."""
    parents = tree.parents.tolist()
    path = []  # products from the root down (the implementation's order: subnormal probabilities round alike)
    for i in range(len(tree)):
        prob = 1.0
        for j in [*reversed(ref_ancestors(parents, i)), i]:
            prob *= float(tree.draft_probs[j])
        path.append(prob)
    depth = [len(ref_ancestors(parents, i)) for i in range(len(tree))]
    order = sorted(range(len(tree)), key=lambda i: (-path[i], depth[i], i))
    ranks = tree.path_ranks(range(len(tree)))
    assert list(ranks) == [order.index(i) for i in range(len(tree))]
    assert all(ranks[i] > ranks[p] for i, p in enumerate(parents) if p >= 0)
    assert tree.path_ranks([]) == ()
    chain = TokenTree.chain(tree.tokens.tolist(), tree.draft_probs.tolist())
    assert chain.path_ranks(range(len(chain))) == tuple(range(len(chain)))


def ref_descendants(parents: list[int], node: int) -> list[int]:
    """Proper descendants of ``node`` in index order, by walking every node's parent links."""
    return [i for i in range(len(parents)) if node in ref_ancestors(parents, i)]


@SETTINGS
@given(trees(with_dists=True).filter(lambda t: t.num_nodes > 0), st.data(), st.sampled_from([0, 64]))
def test_subtree_is_the_descendants_reindexed_with_their_data(tree: TokenTree, data, host_below):
    """On the host (a small tree: one pass over its parents) and through the ancestor mask (a large one)."""
    node = data.draw(st.integers(0, tree.num_nodes - 1))
    with mock.patch.object(tree_module, "HOST_CHECK_BELOW", host_below):
        sub = tree.subtree(node)
    sub = sub.validate(VOCAB)
    parents = tree.parents.tolist()
    kept = ref_descendants(parents, node)
    assert sub.num_nodes == len(kept)
    new_index = {old: new for new, old in enumerate(kept)}
    for new, old in enumerate(kept):
        assert sub.parents[new] == (-1 if parents[old] == node else new_index[parents[old]])
        assert sub.tokens[new] == tree.tokens[old] and sub.draft_probs[new] == tree.draft_probs[old]
        assert sub.sources[new] == tree.sources[old]
        for a, b in zip(sub.draft_dist(new), tree.draft_dist(old), strict=True):
            assert a.tolist() == b.tolist()
    # every path below node is a root path of the subtree, spelling the same tokens
    below = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[len(tree.path_to(node)):]) for i in kept}
    assert below == {tuple(int(sub.tokens[j]) for j in sub.path_to(i)) for i in range(sub.num_nodes)}


@SETTINGS
@given(trees(with_dists=True), st.integers(-2, 30))
def test_head_keeps_the_first_nodes_with_their_distributions(tree: TokenTree, k: int):
    head = tree.head(k).validate(VOCAB)
    n = min(max(k, 0), tree.num_nodes)
    assert head.num_nodes == n
    assert head.tokens.tolist() == tree.tokens[:n].tolist() and head.parents.tolist() == tree.parents[:n].tolist()
    assert head.draft_probs.tolist() == tree.draft_probs[:n].tolist() and head.sources == tree.sources[:n]
    for i in range(n):  # the last node's distribution included
        for a, b in zip(head.draft_dist(i), tree.draft_dist(i), strict=True):
            assert a.tolist() == b.tolist()
    if head.q_cu is not None:
        assert head.q_ids.shape[0] == head.q_cu[-1] == (tree.q_cu[n] if n else 0)


# ------------------------------------------------------------- rejection
def _tree(tokens, parents, probs=None, **kw) -> TokenTree:
    n = len(tokens)
    return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64),
                     np.asarray(probs if probs is not None else [0.5] * n, np.float64), **kw)


@SETTINGS
@given(trees(max_nodes=12).filter(lambda t: t.num_nodes > 0), st.data())
def test_bad_parent_is_rejected(tree: TokenTree, data):
    i = data.draw(st.integers(0, tree.num_nodes - 1))
    bad = data.draw(st.one_of(st.integers(i, i + 5), st.integers(-10, -2)))  # self/forward/below -1
    parents = tree.parents.copy()
    parents[i] = bad
    with pytest.raises(InvalidTreeError, match="parent"):
        _tree(tree.tokens, parents, tree.draft_probs).validate(VOCAB)


@pytest.mark.parametrize("token", [-1, VOCAB, VOCAB + 100])
def test_out_of_vocab_token_is_rejected(token):
    with pytest.raises(InvalidTreeError, match="vocabulary"):
        _tree([1, token, 3], [-1, 0, 0]).validate(VOCAB)


@pytest.mark.parametrize("prob", [-0.1, float("nan"), float("inf"), 1.5])
def test_bad_draft_prob_is_rejected(prob):
    with pytest.raises(InvalidTreeError, match="draft_probs"):
        _tree([1, 2, 3], [-1, 0, 0], [0.5, prob, 0.5]).validate(VOCAB)


@pytest.mark.parametrize("size", [3, HOST_CHECK_BELOW - 1, HOST_CHECK_BELOW, HOST_CHECK_BELOW + 7])
@pytest.mark.parametrize(("field", "value", "error"), [
    ("parents", 5000, "parent"), ("parents", -2, "parent"), ("tokens", -1, "vocabulary"), ("tokens", VOCAB, "vocabulary"),
    ("draft_probs", float("nan"), "draft_probs"), ("draft_probs", float("inf"), "draft_probs"),
    ("draft_probs", -0.1, "draft_probs"), ("draft_probs", 1.5, "draft_probs"), (None, None, None)])
def test_small_and_large_trees_are_checked_alike(size, field, value, error):
    """Trees under HOST_CHECK_BELOW nodes are checked on the host, larger ones with numpy: the same verdicts,
    whichever node is bad (the first, the last)."""
    for node in (0, size - 1):
        tokens, parents, probs = [1 + i % 40 for i in range(size)], list(range(-1, size - 1)), [0.5] * size
        if field is not None:
            {"tokens": tokens, "parents": parents, "draft_probs": probs}[field][node] = value
        tree = _tree(tokens, parents, probs)
        if error is None:
            assert tree.validate(VOCAB) is tree
        else:
            with pytest.raises(InvalidTreeError, match=error):
                tree.validate(VOCAB)


def test_cycle_is_impossible_to_express():
    # a 2-cycle needs some parent >= its own index
    with pytest.raises(InvalidTreeError):
        _tree([1, 2], [1, 0]).validate(VOCAB)
    with pytest.raises(InvalidTreeError):
        _tree([1], [0]).validate(VOCAB)  # self-loop


def test_oversize_trees_are_rejected():
    wide = _tree(list(range(10)), [-1] * 10)
    deep = _tree(list(range(10)), list(range(-1, 9)))
    wide.validate(VOCAB, max_nodes=10, max_depth=1)
    deep.validate(VOCAB, max_nodes=10, max_depth=10)
    with pytest.raises(InvalidTreeError, match="nodes"):
        wide.validate(VOCAB, max_nodes=9)
    with pytest.raises(InvalidTreeError, match="depth"):
        deep.validate(VOCAB, max_depth=9)


@pytest.mark.parametrize(
    "tokens,parents",
    [([3, 4], [-1.0, 0.5]), ([3.5, 4.0], [-1, 0])],
    ids=["fractional_parent", "fractional_token"],
)
def test_non_integer_ids_are_rejected(tokens, parents):
    """A fractional parent is no node at all, and a fractional token no token: validation must say so
    (instead of the derived fields failing later with an IndexError, or the token being truncated)."""
    tree = TokenTree(np.asarray(tokens), np.asarray(parents), np.ones(2))
    with pytest.raises(InvalidTreeError):
        tree.validate(VOCAB)


def test_integral_float_arrays_are_rejected_or_usable():
    tree = TokenTree(np.asarray([3.0, 4.0]), np.asarray([-1.0, 0.0]), np.ones(2))
    try:
        tree.validate(VOCAB)
    except InvalidTreeError:
        return
    # accepted: then everything derived from it must work
    assert tree.depth.tolist() == [0, 1] and tree.children_of(0) == [1] and tree.max_depth == 2


def test_mismatched_array_lengths_are_rejected():
    with pytest.raises(InvalidTreeError):
        TokenTree(np.asarray([1, 2], np.int64), np.asarray([-1], np.int64), np.ones(2)).validate(VOCAB)
    with pytest.raises(InvalidTreeError):
        TokenTree(np.asarray([1, 2], np.int64), np.asarray([-1, 0], np.int64), np.ones(3)).validate(VOCAB)
    with pytest.raises(InvalidTreeError, match="sources"):
        _tree([1, 2], [-1, 0], sources=("a",)).validate(VOCAB)


def _dists_tree(q_cu, q_ids, q_probs, tokens=(3, 4), parents=(-1, 0)) -> TokenTree:
    return _tree(list(tokens), list(parents), q_cu=np.asarray(q_cu, np.int64),
                 q_ids=np.asarray(q_ids, np.int64), q_probs=np.asarray(q_probs, np.float64))


def test_valid_distribution_tree_passes():
    _dists_tree([0, 2, 3], [3, 9, 4], [0.25, 0.75, 1.0]).validate(VOCAB)


@pytest.mark.parametrize(
    "q_cu,q_ids,q_probs,why",
    [
        ([0, 2, 3], [3, 9, 4], [0.25, 0.70, 1.0], "sum"),  # node 0's q sums to 0.95
        ([0, 2, 3], [3, 9, 4], [0.5, 0.75, 0.25], "sum"),  # sums to 1.25 / 0.25
        ([0, 2, 3], [8, 9, 4], [0.25, 0.75, 1.0], "appear"),  # node 0's token 3 missing from its q
        ([0, 2, 3], [3, 9, 4], [0.0, 1.0, 1.0], "appear"),  # token present with probability 0
        ([0, 2, 3], [3, 3, 4], [0.5, 0.5, 1.0], "appear"),  # token listed twice
        ([0, 2, 3], [3, 9, 4], [0.25, float("nan"), 1.0], "finite"),
        ([0, 2, 3], [3, 9, 4], [-0.25, 1.25, 1.0], "non-negative"),
        ([0, 2, 3], [3, VOCAB, 4], [0.25, 0.75, 1.0], "vocabulary"),
        ([0, 3, 3], [3, 9, 4], [0.25, 0.75, 1.0], "non-empty"),  # node 1 gets an empty q
        ([1, 2, 3], [3, 9, 4], [0.25, 0.75, 1.0], "start at 0"),
        ([0, 2, 4], [3, 9, 4], [0.25, 0.75, 1.0], "q_cu"),  # ends past nnz
        ([0, 2], [3, 9], [0.25, 0.75], "q_cu"),  # wrong length
        ([0, 2, 3], [3, 9, 4], [0.25, 0.75], "equal-length"),
    ],
)
def test_malformed_draft_distributions_are_rejected(q_cu, q_ids, q_probs, why):
    with pytest.raises(InvalidTreeError, match=why):
        _dists_tree(q_cu, q_ids, q_probs).validate(VOCAB)


def test_a_checked_tree_is_not_walked_again_but_its_limits_and_other_vocabularies_are():
    """validate walks a tree's elements once per vocabulary size (the drafter link, then the verifier); the node
    and depth limits are checked at every call, and another vocabulary is checked afresh."""
    tree = _tree([1, 2, 3], [-1, 0, 1]).validate(VOCAB)
    assert tree.__dict__["_valid_vocab"] == VOCAB
    assert tree.validate(VOCAB, max_nodes=3, max_depth=3) is tree
    with pytest.raises(InvalidTreeError, match="more than the limit"):
        tree.validate(VOCAB, max_nodes=2)
    with pytest.raises(InvalidTreeError, match="exceeds the limit"):
        tree.validate(VOCAB, max_depth=2)
    with pytest.raises(InvalidTreeError, match="outside the vocabulary"):
        tree.validate(3)
