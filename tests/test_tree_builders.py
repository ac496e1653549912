"""Tree builders (drafter side): TreeBuilder against the set of prefixes it was given."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_service.tree_builders import TreeBuilder

VOCAB = 50
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=8))
def test_tree_builder_shares_prefixes(paths):
    builder = TreeBuilder()
    ends = [builder.add_path(p, source="x") for p in paths]
    tree = builder.build().validate(VOCAB)
    # one node per distinct non-empty prefix
    prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
    assert tree.num_nodes == len(prefixes)
    # every path is found again, ending at the node add_path returned
    for p, end in zip(paths, ends, strict=True):
        assert [int(tree.tokens[i]) for i in tree.path_to(end)] == list(p)
    # no two siblings share a token
    for kids in tree.children:
        toks = [int(tree.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks))


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=8), st.integers(0, 12))
def test_tree_builder_respects_max_nodes(paths, max_nodes):
    builder = TreeBuilder()
    for p in paths:
        builder.add_path(p, max_nodes=max_nodes)
    tree = builder.build().validate(VOCAB, max_nodes=max_nodes)
    # what was kept is ancestor-closed and each kept path is a prefix of an input path
    inputs = {tuple(p) for p in paths}
    for i in range(tree.num_nodes):
        toks = tuple(int(tree.tokens[j]) for j in tree.path_to(i))
        assert any(q[: len(toks)] == toks for q in inputs)


def test_tree_builder_add_dedups_and_keeps_first_prob():
    b = TreeBuilder()
    a = b.add(-1, 7, 0.5, "x")
    assert b.add(-1, 7, 0.9, "y") == a
    c = b.add(a, 7, 0.25)
    assert c != a and b.find(a, 7) == c and b.find(-1, 8) is None
    tree = b.build()
    assert tree.tokens.tolist() == [7, 7] and tree.parents.tolist() == [-1, 0]
    assert tree.draft_probs.tolist() == [0.5, 0.25] and tree.sources == ("x", "")
