"""Token Recycling: the adjacency table, its rank hit rates, and the best-first tree it grows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.proposer import DraftSessionState, make_proposer
from drafter_service.recycling import AdjacencyTable, RankHitRates, expand_tree
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback, VerifyFeedback
from specmesh.sampling import SamplingParams


def _table(rows: dict[int, list[int]], k: int = 3) -> AdjacencyTable:
    table = AdjacencyTable(k)
    for token, succ in rows.items():
        table.update(np.array([token]), np.array([succ]))
    return table


def test_update_replaces_rows_and_counts_the_rank_of_the_targets_top1():
    table = _table({1: [2, 3, 4]})
    assert table.get(1).tolist() == [2, 3, 4]
    table.update(np.array([1]), np.array([[3, 9, 8]]))  # the old row had the new top-1 at rank 1
    table.update(np.array([1]), np.array([[7, 6, 5]]))  # not at all in the old row
    assert table.get(1).tolist() == [7, 6, 5]
    assert table.hit_rates.hits[1] > 0 and table.hit_rates.hits[3] > 0  # rank 1 hit, one miss
    assert table.hit_rates.hits[0] == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 3)), max_size=40), st.floats(0.9, 1.0))
def test_rank_rates_observed_at_once_equal_one_at_a_time(ranks, decay):
    """An update's ranks are counted in one go (``observe_many``): the same counts as one at a time."""
    one, many = RankHitRates(4, decay), RankHitRates(4, decay)
    one.observe(2)
    many.observe(2)
    for rank in ranks:
        one.observe(rank)
    many.observe_many(ranks)
    assert np.allclose(one.hits, many.hits, rtol=1e-12, atol=1e-12)
    assert np.isclose(one.total, many.total, rtol=1e-12) and np.allclose(one.rates(), many.rates(), rtol=1e-12)


def test_a_row_repeated_in_one_update_is_judged_against_the_one_before_it():
    table = _table({1: [2, 3, 4]})
    table.update(np.array([1, 1]), np.array([[3, 9, 8], [8, 5, 6]]))  # rank 1 of the old row, then rank 2 of that one
    assert table.get(1).tolist() == [8, 5, 6]
    assert table.hit_rates.hits[1] > 0 and table.hit_rates.hits[2] > 0 and table.hit_rates.hits[3] == 0


def test_table_is_bounded_least_recently_updated_out():
    table = AdjacencyTable(2, max_entries=3)
    for t in range(5):
        table.update(np.array([t]), np.array([[t + 1, t + 2]]))
    assert len(table) == 3 and table.get(0) is None and table.get(4) is not None


rows_strategy = st.dictionaries(st.integers(0, 6), st.lists(st.integers(0, 6), min_size=3, max_size=3), max_size=7)


@settings(max_examples=200, deadline=None)
@given(rows_strategy, st.integers(0, 6), st.integers(0, 12), st.integers(0, 5))
def test_expanded_tree_is_best_first_within_budget(rows, last, max_nodes, max_depth):
    table = _table(rows)
    tree = expand_tree(table, last, Budget(max_nodes, max_depth), "recycling")
    assert tree.num_nodes <= max_nodes and tree.max_depth <= max_depth
    for kids in tree.children:  # no duplicate siblings
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))
    rates = table.hit_rates.rates()
    for i in range(tree.num_nodes):
        p = int(tree.parents[i])
        parent_token = last if p < 0 else int(tree.tokens[p])
        succ = table.get(parent_token).tolist()
        assert int(tree.tokens[i]) in succ  # every edge is a table entry
        assert tree.draft_probs[i] == rates[succ.index(int(tree.tokens[i]))]
    # path scores: best-first means no node left out scores above one kept (checked on the root's row)
    if last in rows and tree.num_nodes and max_depth >= 1:
        kept = {int(tree.tokens[c]) for c in tree.children_of(-1)}
        assert kept and int(rows[last][0]) in kept  # the best successor is always proposed


def test_proposer_learns_from_feedback_and_drafts_the_targets_habit():
    prop = make_proposer("recycling", k=2)
    assert prop.feedback_topk == 2
    state = DraftSessionState("s", [5, 1], SamplingParams())
    assert prop.propose(state, Budget(4, 4)).num_nodes == 0  # nothing seen yet
    fb = VerifyFeedback.of([1, 2, 3], np.array([[2, 9], [3, 9], [4, 9]]))
    prop.observe(state, DraftFeedback(2, (fb,)))
    tree = prop.propose(state, Budget(5, 3))  # scores .5 (2), .33 (9), .25 (2 3), .17 (2 9), .125 (2 3 4)
    assert tree.num_nodes == 5 and tree.tokens[tree.main_path()].tolist() == [2, 3, 4]
    assert set(tree.sources) == {"recycling"}
