"""AdaptivePolicy and its pure parts: acceptance estimates, cost fit, depth choice, stop threshold, probes."""

from __future__ import annotations

import math
import time
from functools import partial

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from orchestrator import policy as policy_module
from orchestrator.policy import (
    NODE_COST_FRACTION,
    PROBE_DEPTH,
    AdaptivePolicy,
    CostModel,
    LoadAwarePolicy,
    MethodSteps,
    StaticPolicy,
    StepWindow,
    batch_goodput,
    batch_goodput_depth,
    bonus_guess_rate,
    choose_depth,
    choose_nodes,
    choose_overlap,
    conditional_acceptance,
    depth_per_node,
    draft_cpu_per_level,
    expected_tokens,
    fill_ratio,
    fit_costs,
    node_cost,
    nodes_at,
    nodes_for_depth,
    overlap_rate,
    rank_acceptance,
    shrunk_rates,
    step_time,
    stop_threshold,
)
from orchestrator.stats import RequestStats, StepStats
from specmesh.contract import VerifyCosts
from verifier_service.costs import MAX_FACTOR, StepCosts, fit_verify_costs, refit_costs

PHASES = ("sequential", "restart", "predraft")


def _step(depth, accepted, nodes=None, verify=0.010, draft=None, budget=None, **extra) -> StepStats:
    """A step as the sequential engine records it: the verifier waits for the whole draft."""
    nodes = depth if nodes is None else nodes
    draft = 0.001 * depth if draft is None else draft
    return StepStats(
        num_proposed=nodes, tree_depth=depth, num_accepted=accepted, accepted_sources=(), proposed_sources=(),
        draft_seconds=draft, verify_seconds=verify, budget=(nodes, depth) if budget is None else budget,
        **({"step_seconds": verify + draft, "wait_seconds": draft} | extra),
    )


def _stats(steps) -> RequestStats:
    return RequestStats(steps=list(steps))


def _rate(alpha, costs: CostModel, nodes, depth, phase="sequential") -> float:
    """Committed tokens per second of a step ``depth`` deep under the given model."""
    t = step_time(depth, costs.verify(nodes(depth)), costs.draft_per_level, costs.overhead, phase == "predraft")
    return expected_tokens(alpha, depth) / t


alphas = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12)


# ------------------------------------------------------------------ expected tokens, acceptance
@given(alphas, st.data())
def test_expected_tokens_monotone_in_depth_and_alpha(alpha, data):
    values = [expected_tokens(alpha, d) for d in range(len(alpha) + 1)]
    assert values[0] == 1.0
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))
    assert values[-1] <= 1 + len(alpha) + 1e-12
    higher = [min(1.0, a + data.draw(st.floats(0.0, 1.0))) for a in alpha]
    assert all(expected_tokens(higher, d) >= v - 1e-12 for d, v in enumerate(values))


def test_expected_tokens_closed_forms():
    assert expected_tokens([1.0] * 5, 5) == 6.0
    assert expected_tokens([0.5] * 3, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([0.0, 1.0, 1.0], 3) == 1.0


def test_conditional_acceptance_is_the_prior_without_data():
    assert conditional_acceptance([], 5, 0.6, 2.0) == pytest.approx([0.6] * 5)
    empty_trees = [_step(0, 0, budget=(0, 0)) for _ in range(10)]  # plain decoding says nothing
    assert conditional_acceptance(empty_trees, 5, 0.3, 2.0) == pytest.approx([0.3] * 5)


def test_conditional_acceptance_counts_tried_and_accepted():
    steps = [_step(4, 4), _step(4, 0), _step(3, 2)]
    # position 1: tried 3, accepted 2; 2: tried 2 (a >= 1), accepted 2; 3: tried 2, accepted 1; 4: tried 1 of 1
    assert conditional_acceptance(steps, 4, 0.6, 1e-9) == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    # with a prior weight, a position with no data inherits the one above it
    shallow = [_step(2, 2)] * 50
    alpha = conditional_acceptance(shallow, 6, 0.6, 2.0)
    assert alpha[2:] == pytest.approx([alpha[1]] * 4) and alpha[1] > 0.95


@pytest.mark.parametrize("seed", [0, 1])
def test_conditional_acceptance_converges_to_the_true_rates(seed):
    rng = np.random.default_rng(seed)
    true = [0.9, 0.7, 0.5, 0.8]
    steps = []
    for _ in range(20_000):
        depth = int(rng.integers(1, len(true) + 1))
        accepted = 0
        while accepted < depth and rng.random() < true[accepted]:
            accepted += 1
        steps.append(_step(depth, accepted))
    alpha = conditional_acceptance(steps, len(true), 0.6, 2.0)
    reach = np.cumprod([1.0] + true[:-1])  # P(positions before j accepted)
    for j, (est, p) in enumerate(zip(alpha, true, strict=True)):
        tried = len(steps) * reach[j] * (len(true) - j) / len(true)
        assert abs(est - p) < 5 * np.sqrt(p * (1 - p) / tried) + 2 / tried, (j, est, p)


# ------------------------------------------------------------------ costs
def test_fit_costs_recovers_a_linear_verify_cost():
    steps = [_step(d, 0, nodes=2 * d, verify=0.010 + 0.0005 * 2 * d, draft=0.002 * d) for d in (0, 1, 2, 4, 4, 8)]
    costs = fit_costs(steps)
    assert costs.verify_fixed == pytest.approx(0.010) and costs.verify_per_node == pytest.approx(0.0005)
    assert costs.draft_per_level == pytest.approx(0.002)
    assert costs.overhead == pytest.approx(0.0, abs=1e-12)


def test_fit_costs_without_spread_or_history_uses_documented_priors():
    flat = fit_costs([_step(4, 1, verify=0.02)] * 5)
    assert flat.verify_per_node == pytest.approx(flat.verify_fixed * NODE_COST_FRACTION)
    assert flat.verify(4) == pytest.approx(0.02)  # the line goes through the observed mean
    prior = fit_costs([], draft_cost_ratio=0.1)
    assert prior == CostModel(1.0, NODE_COST_FRACTION, 0.1, 0.0)
    # verify times known, no tree drafted yet: draft level = ratio * fitted a
    plain = fit_costs([_step(0, 0, verify=0.03)] * 3, draft_cost_ratio=0.2)
    assert plain.draft_per_level == pytest.approx(0.2 * plain.verify_fixed)


def test_fit_costs_draft_levels_and_overhead():
    steps = [
        _step(4, 2, draft=0.004, step_seconds=0.020, wait_seconds=0.004),  # overhead 6 ms
        _step(2, 1, draft=0.002, step_seconds=0.018, wait_seconds=0.002),  # 6 ms
        _step(4, 4, draft=0.400, predrafted=True, step_seconds=0.017, wait_seconds=0.0),  # 7 ms; draft not counted
        _step(3, 0, draft=0.003, step_seconds=0.001, wait_seconds=0.003),  # negative: clamped to 0
    ]
    costs = fit_costs(steps)
    assert costs.draft_per_level == pytest.approx(0.001)
    assert costs.overhead == pytest.approx(0.006)
    assert fit_costs([_step(2, 1, step_seconds=0.0)]).overhead == 0.0  # step time not recorded


def test_nodes_for_depth():
    assert [nodes_for_depth(d, 6, 6) for d in range(7)] == list(range(7))  # chains
    tree = [nodes_for_depth(d, 16, 4) for d in range(5)]
    assert tree == [0, 4, 8, 12, 16]
    for caps in [(3, 8), (8, 3), (10, 7), (1, 1)]:
        values = [nodes_for_depth(d, *caps) for d in range(caps[1] + 1)]
        assert values[0] == 0 and all(0 < v <= caps[0] for v in values[1:])
        assert all(b >= a for a, b in zip(values, values[1:], strict=False))
        assert all(v >= min(d, caps[0]) for d, v in enumerate(values))


# ------------------------------------------------------------------ depth choice
def _choose(alpha, costs: CostModel, phase="sequential", caps=(8, 8), max_depth=None):
    nodes = partial(nodes_for_depth, max_nodes=caps[0], max_depth=caps[1])
    depth = caps[1] if max_depth is None else max_depth
    return choose_depth(alpha, costs.verify, costs.draft_per_level, costs.overhead, nodes, phase, depth)


costs_st = st.builds(
    CostModel,
    verify_fixed=st.floats(1e-3, 1.0),
    verify_per_node=st.floats(0.0, 1.0 / 32),  # scaled by verify_fixed below
    draft_per_level=st.floats(0.0, 2.0),  # in units of verify_fixed
    overhead=st.floats(0.0, 2.0),
).map(lambda c: CostModel(c.verify_fixed, c.verify_per_node * c.verify_fixed,
                          c.draft_per_level * c.verify_fixed, c.overhead * c.verify_fixed))
caps_st = st.tuples(st.integers(1, 12), st.integers(1, 12)).map(lambda t: (max(t), t[1]))  # nodes >= depth


@pytest.mark.parametrize("phase", PHASES)
def test_choose_depth_is_zero_when_drafts_are_rejected(phase):
    costs = CostModel(0.01, 0.0001, 0.001, 0.0)
    assert _choose([1e-6] * 8, costs, phase) == 0
    assert _choose([0.0] * 8, CostModel(0.01, 0.0, 0.0, 0.0), phase) == 0  # free but useless: ties go shallow


@given(costs_st, caps_st)
def test_choose_depth_is_max_when_drafts_are_accepted_and_verify_is_flat(costs, caps):
    assume(costs.draft_per_level < 0.9 * (costs.verify_fixed + costs.overhead))
    flat = CostModel(costs.verify_fixed, 0.0, costs.draft_per_level, costs.overhead)
    assert _choose([1.0] * caps[1], flat, "sequential", caps) == caps[1]


@given(costs_st, caps_st, st.data())
def test_choose_depth_is_the_best_rate(costs, caps, data):
    alpha = data.draw(st.lists(st.floats(0.0, 1.0), min_size=caps[1], max_size=caps[1]))
    phase = data.draw(st.sampled_from(PHASES))
    nodes = partial(nodes_for_depth, max_nodes=caps[0], max_depth=caps[1])
    depth = _choose(alpha, costs, phase, caps)
    rates = [_rate(alpha, costs, nodes, d, phase) for d in range(caps[1] + 1)]
    assert rates[depth] >= max(rates) * (1 - 1e-9)
    assert all(r < rates[depth] * (1 + 1e-9) for r in rates[:depth])  # no shallower tree does as well


@given(costs_st, caps_st, st.data())
def test_higher_acceptance_never_lowers_the_depth(costs, caps, data):
    alpha = data.draw(st.lists(st.floats(0.0, 1.0), min_size=caps[1], max_size=caps[1]))
    higher = [min(1.0, a + data.draw(st.floats(0.0, 1.0))) for a in alpha]
    phase = data.draw(st.sampled_from(PHASES))
    assert _choose(higher, costs, phase, caps) >= _choose(alpha, costs, phase, caps)


@given(costs_st, caps_st, st.data())
def test_predraft_never_picks_a_shallower_tree_than_sequential(costs, caps, data):
    """Holds while the sequential choice's drafting fits in its verification (then predraft makes drafting
    free). Beyond that it need not: with a = 1, b = 0, a level costing 0.5 and alpha = 1, sequential goes as
    deep as allowed (rate (1+d)/(1+0.5d) grows) but predraft stops at depth 2, where drafting still hides."""
    alpha = data.draw(st.lists(st.floats(0.0, 1.0), min_size=caps[1], max_size=caps[1]))
    nodes = partial(nodes_for_depth, max_nodes=caps[0], max_depth=caps[1])
    sequential = _choose(alpha, costs, "sequential", caps)
    assume(costs.draft_per_level * sequential <= costs.verify(nodes(sequential)))
    assert _choose(alpha, costs, "predraft", caps) >= sequential
    assert _choose(alpha, costs, "restart", caps) == sequential


def test_predraft_counterexample_when_drafting_outlasts_verification():
    costs = CostModel(1.0, 0.0, 0.5, 0.0)
    assert _choose([1.0] * 8, costs, "sequential") == 8
    assert _choose([1.0] * 8, costs, "predraft") == 2


# ------------------------------------------------------------------ node choice (sequential steps)
def test_rank_acceptance_is_the_prior_without_data():
    assert rank_acceptance([], 4, prior=0.7) == ([0.7] * 4, [1.0] * 4)
    assert rank_acceptance([], 0) == ([], [])


def test_rank_acceptance_counts_tried_sent_and_accepted_ranks():
    steps = [_step(2, 2, nodes=6, budget=(8, 4), accepted_ranks=(0, 3)),  # a tree: its 1st and 4th best nodes
             _step(1, 0, nodes=2, budget=(8, 4), accepted_ranks=()),
             _step(0, 0, nodes=0, budget=(8, 4))]  # nothing matched: no tree
    p, sent = rank_acceptance(steps, 8, prior=0.5, prior_weight=1e-9)
    assert p[:6] == pytest.approx([0.5, 0.0, 0.0, 1.0, 0.0, 0.0], abs=1e-6)  # ranks 0-1 tried twice, 2-5 once
    assert p[6:] == pytest.approx([0.0, 0.0], abs=1e-6)  # never tried: the rank before's estimate
    assert sent == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0], abs=1e-6)
    # without recorded ranks the accepted nodes are the top ones (a chain's)
    assert rank_acceptance([_step(3, 2)], 3, prior_weight=1e-9)[0] == pytest.approx([1.0, 1.0, 0.0], abs=1e-6)
    # shrinkage: each rank towards the one before it
    p, _ = rank_acceptance([_step(1, 1, nodes=1)], 2, prior=0.5, prior_weight=1.0)
    assert p == pytest.approx([0.75, 0.75])


def test_rank_acceptance_converges_to_the_true_rates():
    rng = np.random.default_rng(3)
    truth = np.array([0.8, 0.5, 0.3, 0.2, 0.1, 0.05])
    steps = []
    for _ in range(4000):
        n = int(rng.integers(0, 7))
        ranks = tuple(int(k) for k in np.flatnonzero(rng.random(n) < truth[:n]))
        steps.append(_step(n, len(ranks), nodes=n, budget=(6, 6), accepted_ranks=ranks))
    p, sent = rank_acceptance(steps, 6)
    assert p == pytest.approx(truth, abs=0.04)
    assert sent == pytest.approx([(6 - k) / 7 for k in range(6)], abs=0.04)  # n uniform on 0..6, budget 6


def test_depth_per_node():
    assert depth_per_node([]) == 1.0
    assert depth_per_node([_step(4, 0, nodes=8), _step(2, 0, nodes=8), _step(0, 0)]) == pytest.approx(6 / 16)


def _node_rate(p, sent, costs: CostModel, draft, n):
    rows = sum(sent[:n])
    return (1 + sum(s * a for s, a in zip(sent[:n], p[:n], strict=True))) / (
        costs.overhead + costs.verify(rows) + draft(n))


@given(costs_st, st.integers(0, 16), st.data())
def test_choose_nodes_is_the_best_rate(costs, max_nodes, data):
    p = data.draw(st.lists(st.floats(0.0, 1.0), min_size=max_nodes, max_size=max_nodes))
    sent = data.draw(st.lists(st.floats(0.0, 1.0), min_size=max_nodes, max_size=max_nodes))
    levels = data.draw(st.floats(0.1, 1.0))

    def draft(n):
        return costs.draft_per_level * max(1, round(levels * n)) if n else 0.0

    n = choose_nodes(p, sent, costs.verify, draft, costs.overhead, max_nodes)
    rates = [_node_rate(p, sent, costs, draft, k) for k in range(max_nodes + 1)]
    assert rates[n] >= max(rates) * (1 - 1e-9)
    assert all(r < rates[n] * (1 + 1e-9) for r in rates[:n])  # no smaller budget does as well
    # better acceptance beyond the chosen ranks never shrinks the tree (raising all ranks may: a smaller tree's
    # rate can gain more than the chosen one's)
    higher = [a if k < n else min(1.0, a + 0.2) for k, a in enumerate(p)]
    assert choose_nodes(higher, sent, costs.verify, draft, costs.overhead, max_nodes) >= n


def test_choose_nodes_extremes():
    costs = CostModel(0.01, 0.0005, 0.0, 0.0)
    assert choose_nodes([0.0] * 8, [1.0] * 8, costs.verify, lambda n: 0.0, 0.0, 8) == 0
    assert choose_nodes([1.0] * 8, [1.0] * 8, costs.verify, lambda n: 0.0, 0.0, 8) == 8
    # a node pays while its acceptance beats its cost over the seconds per committed token
    p = [0.9, 0.6, 0.3, 0.04, 0.02, 0.01]
    assert choose_nodes(p, [1.0] * 6, costs.verify, lambda n: 0.0, 0.0, 6) == 3


def test_sequential_trees_at_most_double_the_largest_budget_of_the_window():
    """Ranks never tried inherit the last tried one's estimate; the policy trusts that for one doubling."""
    policy = AdaptivePolicy(max_nodes=24, max_depth=12, window=8)
    history = [_step(3, 3, nodes=3, budget=(3, 3), verify=0.0103) for _ in range(8)]  # all accepted, cheap
    assert policy.next_budget(_stats(history), 100).max_nodes == 6
    history += [_step(6, 6, nodes=6, budget=(6, 6), verify=0.0106)]
    assert policy.next_budget(_stats(history), 100).max_nodes == 12
    assert policy.next_budget(_stats([_step(1, 1, nodes=1, budget=(1, 1))] * 8), 100).max_nodes == 2 * PROBE_DEPTH


@pytest.mark.parametrize("true_p, per_node", [([0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0], 0.0008),
                                              ([0.5, 0.2, 0.1, 0.05] + [0.01] * 8, 0.0008),
                                              ([0.95] * 12, 0.0001), ([0.1] * 12, 0.003)])
def test_sequential_steps_settle_near_the_best_node_count(true_p, per_node):
    """Simulated requests whose tree nodes are accepted with known per-rank rates: the node counts the policy
    settles on commit nearly as many tokens per second as the best count under the true model."""
    rng = np.random.default_rng(11)
    truth = CostModel(0.010, per_node, 0.0002, 0.0005)
    policy = AdaptivePolicy(max_nodes=12, max_depth=6)
    stats = RequestStats()
    for _ in range(300):
        budget = policy.next_budget(stats, 10_000)
        nodes, depth = budget.max_nodes, min(budget.max_depth, (budget.max_nodes + 1) // 2)  # a 2-wide tree
        ranks = tuple(int(k) for k in np.flatnonzero(rng.random(nodes) < np.asarray(true_p[:nodes])))
        verify, draft = truth.verify(nodes) * rng.uniform(0.95, 1.05), truth.draft_per_level * depth
        stats.steps.append(StepStats(
            nodes, depth, len(ranks), (), (), draft, verify, budget=(nodes, budget.max_depth),
            step_seconds=verify + draft + truth.overhead, wait_seconds=draft, accepted_ranks=ranks,
        ))
    steps, every = stats.steps, policy.probe_every
    probes = {i for i in range(every, len(steps)) if all(s.budget[1] == 0 for s in steps[i - every:i])}
    chosen = [s.num_proposed for i, s in enumerate(steps) if i >= len(steps) - 100 and i not in probes]

    def draft(n):
        return truth.draft_per_level * ((n + 1) // 2)

    rates = [_node_rate(true_p, [1.0] * 12, truth, draft, n) for n in range(13)]
    assert np.mean([rates[n] for n in chosen]) >= 0.95 * max(rates), (chosen, rates)


# ------------------------------------------------------------------ stop threshold
@given(st.floats(0.0, 10.0), st.floats(1e-6, 10.0), st.floats(0.0, 1.0), st.floats(0.0, 10.0))
def test_stop_threshold_in_range_and_monotone_in_cost(cost, per_token, max_stop, extra):
    low, high = stop_threshold(cost, per_token, max_stop), stop_threshold(cost + extra, per_token, max_stop)
    assert 0.0 <= low <= high <= max_stop


def test_node_cost_counts_drafting_unless_hidden():
    costs = CostModel(0.010, 0.0001, 0.001, 0.0)
    assert node_cost(costs, 4, 8, hidden=False) == pytest.approx(0.0005 + 0.0001)
    assert node_cost(costs, 4, 8, hidden=True) == pytest.approx(0.0001)  # drafting fits in verification
    slow = CostModel(0.010, 0.0001, 0.005, 0.0)  # 4 levels = 20 ms > 10.8 ms of verification
    assert node_cost(slow, 4, 8, hidden=True) == pytest.approx(0.0025)


# ------------------------------------------------------------------ the policy
def _history(draw_steps):
    return st.lists(
        st.builds(
            lambda d, a, width, v, c, budget_zero: _step(
                d, min(a, d), nodes=d * width, verify=v, draft=c * d, budget=(0, 0) if budget_zero and not d else None
            ),
            st.integers(0, 10), st.integers(0, 10), st.integers(1, 3), st.floats(1e-4, 0.1), st.floats(0.0, 0.05),
            st.booleans(),
        ),
        max_size=draw_steps,
    )


@given(_history(60), st.integers(-2, 20), st.sampled_from(PHASES), caps_st, st.floats(0.0, 1.0))
def test_next_budget_respects_caps_and_the_end(steps, remaining, phase, caps, max_stop):
    policy = AdaptivePolicy(max_nodes=caps[0], max_depth=caps[1], max_stop=max_stop)
    budget = policy.next_budget(_stats(steps), remaining, phase)
    assert budget.max_depth <= min(caps[1], max(remaining - 1, 0))
    assert budget.max_nodes <= caps[0]
    assert (budget.max_depth == 0) == (budget.max_nodes == 0)
    assert budget.max_nodes >= budget.max_depth
    assert 0.0 <= budget.min_path_prob <= max_stop


@pytest.mark.parametrize("phase", PHASES)
def test_first_step_speculates(phase):
    budget = AdaptivePolicy(max_nodes=16, max_depth=8, draft_timeout_s=0.5).next_budget(RequestStats(), 100, phase)
    assert 0 < budget.max_depth <= 8
    if phase == "sequential":  # a node count (at first at most 2 * PROBE_DEPTH); the drafter shapes the tree
        assert budget.max_nodes == budget.max_depth == 2 * PROBE_DEPTH
    else:  # a depth, with the caps' nodes per level
        assert budget.max_nodes == 2 * budget.max_depth
    assert budget.deadline is not None and budget.deadline > time.monotonic()


def _bad_history(n=20):
    """Drafts always rejected, a draft level costing a tenth of a verification: speculation does not pay."""
    return [_step(4, 0, draft=0.004, verify=0.010 + 0.0002 * 4) for _ in range(n)]


def test_probe_after_probe_every_steps_without_a_tree():
    policy = AdaptivePolicy(8, 8, probe_every=8)
    zero = _step(0, 0, verify=0.010, budget=(0, 0))
    assert policy.next_budget(_stats(_bad_history()), 100).is_zero
    assert policy.next_budget(_stats(_bad_history() + [zero] * 7), 100).is_zero
    probe = policy.next_budget(_stats(_bad_history() + [zero] * 8), 100)
    assert probe.max_depth == PROBE_DEPTH and probe.max_nodes == policy.nodes(PROBE_DEPTH)
    assert policy.next_budget(_stats(_bad_history() + [zero] * 8), 2).max_depth == 1  # still not past the end
    # the step after a (rejected) probe: no tree again until the next probe_every zeros
    after = _bad_history() + [zero] * 8 + [_step(2, 0, verify=0.0104, draft=0.002)]
    assert policy.next_budget(_stats(after), 100).is_zero
    assert AdaptivePolicy(8, 8, probe_every=0).next_budget(_stats(_bad_history() + [zero] * 8), 100).is_zero


def test_no_probe_when_even_accepted_drafts_would_not_pay():
    slow = [_step(4, 0, draft=0.400, verify=0.0108) for _ in range(20)]  # a draft level: 10 verifications
    zero = _step(0, 0, verify=0.010, budget=(0, 0))
    assert AdaptivePolicy(8, 8).next_budget(_stats(slow + [zero] * 8), 100).is_zero


def test_a_request_recovers_once_bad_history_leaves_the_window():
    policy = AdaptivePolicy(8, 8, window=32, probe_every=0)
    zero = _step(0, 0, verify=0.010, budget=(0, 0))
    assert policy.next_budget(_stats(_bad_history(100) + [zero] * 16), 100).is_zero  # 16 bad steps in the window
    assert not policy.next_budget(_stats(_bad_history(100) + [zero] * 32), 100).is_zero


def test_min_path_prob_grows_with_the_draft_cost():
    def history(level_seconds):
        return [_step(4, 3, nodes=8, draft=4 * level_seconds, verify=0.0116) for _ in range(32)]

    policy = AdaptivePolicy(max_nodes=16, max_depth=8)
    cheap, dear = (policy.next_budget(_stats(history(c)), 100) for c in (0.0002, 0.002))
    assert not cheap.is_zero and not dear.is_zero
    assert 0.0 < cheap.min_path_prob < dear.min_path_prob <= policy.max_stop
    hidden = policy.next_budget(_stats(history(0.0002)), 100, "predraft")
    assert hidden.min_path_prob < cheap.min_path_prob  # drafting is free: only the verify cost per node counts


@pytest.mark.parametrize(
    "true_alpha, level_seconds",
    [([0.9] * 8, 0.0005), ([0.8, 0.8, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3], 0.0005), ([0.15] * 8, 0.002),
     ([0.9] * 8, 0.05)],
)
def test_closed_loop_settles_near_the_best_depth(true_alpha, level_seconds):
    """Simulated requests with known acceptance and costs: the depths the policy settles on commit nearly as
    many tokens per second as the best depth under the true model (probes excluded)."""
    rng = np.random.default_rng(7)
    truth = CostModel(0.010, 0.0002, level_seconds, 0.001)
    policy = AdaptivePolicy(max_nodes=8, max_depth=8)
    stats = RequestStats()
    for _ in range(300):
        budget = policy.next_budget(stats, 10_000)
        depth, nodes = budget.max_depth, budget.max_nodes
        accepted = 0
        while accepted < depth and rng.random() < true_alpha[accepted]:
            accepted += 1
        verify, draft = truth.verify(nodes) * rng.uniform(0.95, 1.05), level_seconds * depth
        stats.steps.append(StepStats(
            nodes, depth, accepted, (), (), draft, verify, budget=(nodes, depth),
            step_seconds=verify + draft + truth.overhead, wait_seconds=draft,
        ))
    steps, every = stats.steps, policy.probe_every
    probes = {i for i in range(every, len(steps)) if all(s.budget[1] == 0 for s in steps[i - every:i])}
    chosen = [s.tree_depth for i, s in enumerate(steps) if i >= len(steps) - 100 and i not in probes]
    rates = [_rate(true_alpha, truth, policy.nodes, d) for d in range(9)]
    mean_rate = np.mean([rates[d] for d in chosen])
    assert mean_rate >= 0.93 * max(rates), (chosen, rates)


def test_next_budget_is_cheap():
    steps = [_step(d % 9, d % 5 if d % 9 else 0, nodes=2 * (d % 9)) for d in range(1000)]
    stats, policy = _stats(steps), AdaptivePolicy(max_nodes=16, max_depth=8)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        policy.next_budget(stats, 100)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 2e-3, per_call  # ~100 µs on an idle core; generous for a busy machine


# ------------------------------------------------------------------ the overlapped loop
def test_bonus_guess_rate_and_fill_ratio_start_at_their_priors_and_follow_the_data():
    assert bonus_guess_rate([], prior=0.6) == pytest.approx(0.6)
    hits = [_step(2, 2, ahead_confirmed=True, predraft_used=2)] * 50
    misses = [_step(2, 2, ahead_confirmed=True, predraft_used=0)] * 50
    unconfirmed = [_step(2, 0, ahead_confirmed=False, predraft_used=0)] * 50  # say nothing about guessing
    assert bonus_guess_rate(hits + misses + unconfirmed) == pytest.approx(0.5, abs=0.01)
    assert fill_ratio([]) == 1.0
    half = [_step(4, 0, nodes=4, budget=(8, 4))] * 50  # the drafter proposed half of its budget
    assert fill_ratio(half) == pytest.approx(0.5, abs=0.01)


def test_overlap_rate_without_hits_is_the_restart_rate():
    assert overlap_rate((2.0, 0.5, 0.02), (5.0, 0.9, 0.01), guess=0.0) == pytest.approx(2.0 / 0.02)
    # always confirmed and guessed: ahead steps run forever, the rate tends to theirs
    assert overlap_rate((1.0, 1.0, 0.02), (5.0, 1.0, 0.01), guess=1.0) == pytest.approx(5.0 / 0.01, rel=1e-3)


@given(alpha=st.lists(st.floats(0, 1), min_size=0, max_size=8), guess=st.floats(0, 1),
       a=st.floats(1e-3, 0.05), b=st.floats(0, 0.01), draft=st.floats(0, 0.02), overhead=st.floats(0, 0.01))
def test_choose_overlap_picks_the_best_pair_of_the_grid(alpha, guess, a, b, draft, overhead):
    costs = CostModel(a, b, draft, overhead)
    depth = len(alpha)
    nodes = partial(nodes_for_depth, max_nodes=2 * max(depth, 1), max_depth=max(depth, 1))
    dr, da = choose_overlap(alpha, guess, costs, nodes, depth)

    def figures(d, hidden):
        verify = costs.verify(nodes(d))
        seconds = overhead + (max(verify, draft * (d + 1)) if hidden else draft * d + verify)
        return expected_tokens(alpha, d), float(np.prod(alpha[:d])), seconds

    rates = {(r, h): overlap_rate(figures(r, False), figures(h, True), guess)
             for r in range(depth + 1) for h in range(depth + 1)}
    assert rates[dr, da] >= max(rates.values()) * (1 - 1e-9)


def test_choose_overlap_stops_drafting_when_nothing_is_accepted():
    costs = CostModel(0.01, 0.002, 0.002, 0.001)
    assert choose_overlap([0.0] * 4, 0.9, costs, lambda d: d, 4) == (0, 0)


# ------------------------------------------------------------------ load-aware cap

CPU_LIKE = VerifyCosts(base=3.5e-3, per_session=0.4e-3, per_row=0.2e-3)  # measured on the stdlib target (2 cores)


@given(st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8), st.integers(1, 64), st.floats(1e-6, 1e-3))
def test_trees_never_grow_with_the_batch(alpha, sessions, per_row):
    """Every extra row costs (per_row > 0): a deeper tree's cost ratio to a shallower one grows with the batch."""
    costs = VerifyCosts(3e-3, 0.3e-3, per_row)
    depths = [batch_goodput_depth(alpha, costs, b, 16, 8) for b in (sessions, sessions + 1, 2 * sessions)]
    assert depths == sorted(depths, reverse=True)


def test_free_rows_keep_the_whole_tree_and_costly_rows_drop_it():
    alpha = [0.7] * 8
    assert batch_goodput_depth(alpha, VerifyCosts(3e-3, 0.0, 0.0), 32, 16, 8) == 8
    assert batch_goodput_depth([0.2] * 8, VerifyCosts(1e-3, 0.0, 1e-3), 32, 16, 8) == 0
    # on the measured CPU costs: a well-accepted proposer keeps a tree at 16 sessions, a poor one does not
    assert batch_goodput_depth([0.9] * 8, CPU_LIKE, 16, 16, 8) > 0
    assert batch_goodput_depth([0.3] * 8, CPU_LIKE, 16, 16, 8) == 0


def _goodput_by_passes(alpha, costs, sessions, max_nodes, max_depth, fill=1.0, draft_per_level=0.0):
    """``batch_goodput`` as first written (one ``expected_tokens`` and ``nodes_at`` per depth): the reference its
    level-at-a-time loop is held to. (depth, every depth's rate)."""
    best, best_rate, rates = 0, 0.0, []
    for depth in range(max_depth + 1):
        rows = sessions * (1 + fill * nodes_at(depth, max_nodes, max_depth))
        rate = expected_tokens(alpha, depth) / (costs.seconds(sessions, rows) + sessions * depth * draft_per_level)
        rates.append(rate)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = depth, rate
    return best, rates


@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=12), st.integers(1, 64), st.integers(0, 64),
       st.floats(1e-4, 1e-2), st.floats(-1e-4, 1e-3), st.floats(-1e-5, 1e-3), st.floats(0.0, 1.5),
       st.floats(0.0, 1e-3))
def test_batch_goodput_depth_equals_the_pass_per_depth(alpha, sessions, max_nodes, base, per_session, per_row, fill,
                                                        draft_per_level):
    costs = VerifyCosts(base, per_session, per_row)
    args = (alpha, costs, sessions, max_nodes, len(alpha), fill, draft_per_level)
    try:
        want, rates = _goodput_by_passes(*args)
    except ZeroDivisionError:  # a fitted line through zero seconds at some depth: both refuse it
        with pytest.raises(ZeroDivisionError):
            batch_goodput_depth(*args)
        return
    assert batch_goodput_depth(*args) == want
    tree_gain, plain = batch_goodput(*args)[1], rates[0]
    if plain <= 0.0:
        assert tree_gain == math.inf
    else:
        assert tree_gain == pytest.approx(max([0.0, *rates[1:]]) / plain, rel=1e-9, abs=1e-12)


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 20), st.integers(0, 12),
                          st.floats(0.0, 1e-3)), max_size=80),
       st.integers(1, 40), st.lists(st.integers(1, 8), min_size=1, max_size=12), st.integers(0, 14))
def test_step_window_counts_equal_a_pass_over_the_window(steps, size, batches, max_depth):
    """Steps appended a few at a time (``batches``), the window synced after each: its acceptance and fill equal
    ``conditional_acceptance`` / ``fill_ratio`` of the last ``size`` steps exactly, whatever the depth cap; a new
    list is counted afresh."""
    made = [_step(depth, min(accepted, depth), nodes=nodes, budget=(nodes, budget_depth), draft_cpu_seconds=cpu)
            for depth, accepted, nodes, budget_depth, cpu in steps]
    window, history, at = StepWindow(size), [], 0
    for batch in batches * (1 + len(made) // max(sum(batches), 1)):
        history += made[at : at + batch]
        at += batch
        window.sync(history)
        last = history[-size:]
        assert window.acceptance(max_depth, 0.6, 4.0) == conditional_acceptance(last, max_depth, 0.6, 4.0)
        assert window.fill() == fill_ratio(last)
        assert window.levels == sum(s.budget[1] for s in last)
        assert window.draft_per_level() == pytest.approx(draft_cpu_per_level(last), rel=1e-9, abs=1e-15)
        if at >= len(made):
            break
    fresh = list(history[:3])
    window.sync(fresh)
    assert window.acceptance(max_depth, 0.6, 4.0) == conditional_acceptance(fresh[-size:], max_depth, 0.6, 4.0)


def test_load_aware_policy_caps_only_under_load():
    inner = StaticPolicy(16, 8)
    policy = LoadAwarePolicy(inner, VerifyCosts(1e-3, 0.0, 1e-4))
    poor = [_step(8, 0, nodes=16, batch_sessions=32) for _ in range(10)]
    assert policy.next_budget(RequestStats(), 100) == inner.next_budget(RequestStats(), 100)  # no step yet
    alone = [_step(8, 0, nodes=16) for _ in range(10)]
    assert policy.next_budget(RequestStats(steps=alone), 100) == inner.next_budget(RequestStats(steps=alone), 100)
    capped = policy.next_budget(RequestStats(steps=poor), 100)
    assert (capped.max_nodes, capped.max_depth) == (0, 0)
    good = [_step(8, 8, nodes=16, batch_sessions=4) for _ in range(10)]
    kept = policy.next_budget(RequestStats(steps=good), 100)
    assert kept.max_depth > 0 and kept.max_nodes == nodes_at(kept.max_depth, 16, 8)


def test_a_firm_cap_at_nothing_is_held_unless_the_batch_shrinks():
    """A cap that takes the budget firmly to nothing (the best tree's goodput under ``hold_below`` of none's) is
    held there for the next ``hold_steps`` steps without being computed (nor the inner policy asked), whatever
    the costs did meanwhile; then it is computed afresh. Nothing near a tie is computed again at every step. A
    batch shrunk to 3/4 ends a hold at once; each phase holds on its own; ``hold_steps`` 0 never holds."""
    asked = []

    class Counting(StaticPolicy):
        def next_budget(self, stats, remaining_tokens, phase="sequential"):
            asked.append(len(stats.steps))
            return super().next_budget(stats, remaining_tokens, phase)

    class Costs:  # the verifier's costs as a StepCosts refits them: they change under the policy
        per_row = 1e-4  # with these steps' acceptance at 32 sessions: the best tree at 0.75 of none's goodput

        def seconds(self, sessions, rows):
            return 1e-3 + self.per_row * rows

    costs = Costs()
    policy = LoadAwarePolicy(Counting(16, 8), costs, hold_steps=8)
    fresh = LoadAwarePolicy(StaticPolicy(16, 8), costs, hold_steps=0)
    stats = _stats(_step(8, 3, nodes=16, batch_sessions=32) for _ in range(10))

    def step(phase="predraft"):  # one step: its budget, then the step it ran
        budget = policy.next_budget(stats, 100, phase)
        stats.steps.append(_step(8, 3, nodes=16, batch_sessions=32))
        return budget

    assert all(step().is_zero for _ in range(20))
    assert asked == [10, 19, 28]  # computed, then held 8 steps
    costs.per_row = 1e-7  # now trees pay: nothing until the hold ends, then trees
    assert not fresh.next_budget(stats, 100, "predraft").is_zero
    budgets = [step() for _ in range(10)]
    assert all(b.is_zero for b in budgets[:7]) and not any(b.is_zero for b in budgets[7:])  # computed at 37
    assert policy.next_budget(stats, 100, "sequential") == fresh.next_budget(stats, 100)  # a phase of its own
    costs.per_row, asked[:] = 3e-5, []  # nothing, near a tie (0.95 of none's goodput): never held
    assert all(step().is_zero for _ in range(5))
    assert asked == [40, 41, 42, 43, 44]
    costs.per_row = 1e-4
    assert step().is_zero  # firm: held from here
    costs.per_row = 1e-7
    stats.steps.append(_step(8, 3, nodes=16, batch_sessions=25))
    assert policy.next_budget(stats, 100, "predraft").is_zero  # a request or so fewer does not end it
    stats.steps.append(_step(8, 3, nodes=16, batch_sessions=24))
    assert not policy.next_budget(stats, 100, "predraft").is_zero  # 3/4 of the batch it was held at: computed
    never = LoadAwarePolicy(Counting(16, 8), costs, hold_steps=0)
    costs.per_row, asked[:] = 1e-4, []
    for _ in range(5):
        assert never.next_budget(stats, 100).is_zero
        stats.steps.append(_step(8, 3, nodes=16, batch_sessions=32))
    assert len(asked) == 5


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 20)), max_size=60),
       st.integers(1, 20), st.integers(0, 14))
def test_method_steps_pool_the_last_steps_that_asked_for_a_tree(steps, size, max_depth):
    """Requests' steps fed in turn: the pool's acceptance equals ``conditional_acceptance`` of the last ``size``
    steps with a budget, whichever request took them; steps without a budget stay out."""
    made = [_step(depth, min(accepted, depth), nodes=nodes, budget=(nodes, depth)) for depth, accepted, nodes in steps]
    pooled, taken = MethodSteps(size=size), []
    for at in range(0, len(made), 3):
        pooled.add(made[at : at + 3])
        taken += [s for s in made[at : at + 3] if s.budget[0] > 0]
        want = conditional_acceptance(taken[-size:], max_depth, 0.6, 4.0)
        assert pooled.acceptance(max_depth, 0.6, 4.0) == want
        assert pooled.acceptance(max_depth, 0.6, 4.0) is pooled.acceptance(max_depth, 0.6, 4.0)  # once per change
        assert pooled.window.tried == sum(1 for s in taken[-size:] if min(s.tree_depth, s.num_accepted + 1) > 0)


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=8),
       st.lists(st.floats(0, 1), min_size=8, max_size=8), st.floats(0.5, 8))
def test_rates_shrunk_towards_a_base_take_it_where_nothing_was_tried(counts, base, weight):
    tried = [t for t, _ in counts]
    accepted = [min(a, t) for t, a in counts]
    rates = shrunk_rates(tried, accepted, 0.6, weight, base)
    for j, (t, a) in enumerate(zip(tried, accepted, strict=True)):
        assert rates[j] == pytest.approx((a + weight * base[j]) / (t + weight))
    assert shrunk_rates([0] * 8, [0] * 8, 0.6, weight, base) == pytest.approx(base)


def test_a_first_tree_is_capped_for_the_running_requests_at_the_methods_acceptance():
    """With a pool of the method's steps: a request's first tree is the inner budget until the pool has tried
    ``min_pooled`` steps; then it is capped for the requests running now at the pool's acceptance (nothing where
    the others' trees did not pay at that batch, the whole budget where they did), and a request alone keeps the
    inner budget. Each request's steps are taken in once; its own estimate is shrunk towards the pool's."""
    running = [32]
    pooled = MethodSteps(lambda: running[0])
    inner = StaticPolicy(16, 8)
    policy = LoadAwarePolicy(inner, VerifyCosts(1e-3, 0.0, 1e-4), pooled=pooled, min_pooled=8)
    first = inner.next_budget(RequestStats(), 100)
    other = _stats(_step(8, 0, nodes=16, batch_sessions=32) for _ in range(5))
    policy.next_budget(other, 100)
    policy.next_budget(other, 100)  # nothing new: taken in once
    assert pooled.window.tried == 5
    assert policy.next_budget(RequestStats(), 100) == first  # 5 of 8 tried: not enough to judge by
    policy.next_budget(_stats(_step(8, 0, nodes=16, batch_sessions=32) for _ in range(3)), 100)  # another request
    assert pooled.window.tried == 8
    assert policy.next_budget(RequestStats(), 100).is_zero  # trees rejected at the first token: none at 32
    running[0] = 1
    assert policy.next_budget(RequestStats(), 100) == first  # alone: the inner budget
    alone = LoadAwarePolicy(inner, VerifyCosts(1e-3, 0.0, 1e-4))  # without a pool: as before, the inner budget
    running[0] = 32
    assert alone.next_budget(RequestStats(), 100) == first
    good = MethodSteps(lambda: 32)
    accepting = LoadAwarePolicy(inner, VerifyCosts(1e-3, 0.0, 1e-6), pooled=good)  # a row costs 1/1000 a step
    accepting.next_budget(_stats(_step(8, 8, nodes=16, batch_sessions=32) for _ in range(8)), 100)
    assert accepting.next_budget(RequestStats(), 100) == first  # the others' whole trees were accepted
    # one own step that tried a tree: shrunk towards the pool (all accepted), not the fixed prior (0.6)
    costs = VerifyCosts(1e-3, 0.0, 1e-5)
    mine = _stats([_step(8, 8, nodes=16, batch_sessions=32)])
    deeper = LoadAwarePolicy(inner, costs, pooled=good).next_budget(mine, 100).max_depth
    assert deeper > LoadAwarePolicy(inner, costs).next_budget(mine, 100).max_depth > 0


def test_a_load_aware_choice_is_made_again_only_when_what_it_reads_changed(monkeypatch):
    """The cap's choice is reused while the request's window, the method's pool, the costs' current fit, the
    batch and the inner budget stay as they were (a step without a tree changes none of them), per phase; costs
    that may change in place (no ``current``, not a ``VerifyCosts``) are read every time."""
    chosen = []
    real = policy_module.batch_goodput
    monkeypatch.setattr(policy_module, "batch_goodput", lambda *a: chosen.append(a[2]) or real(*a))
    costs = StepCosts(VerifyCosts(1e-3, 0.0, 3e-5), refit_every=2)
    pooled = MethodSteps(lambda: 16)
    policy = LoadAwarePolicy(StaticPolicy(16, 8), costs, pooled=pooled, hold_steps=0)
    stats = _stats([_step(8, 3, nodes=16, batch_sessions=16)])
    plain = partial(_step, 0, 0, nodes=0, budget=(0, 0))

    def calls(phase="predraft"):
        policy.next_budget(stats, 100, phase)
        return len(chosen)

    first = policy.next_budget(stats, 100, "predraft")
    assert policy.next_budget(stats, 100, "predraft") == first and len(chosen) == 1
    stats.steps.append(plain(batch_sessions=16))
    assert calls() == 1  # a step without a tree
    assert calls("sequential") == 2 and calls("sequential") == 2  # a phase of its own
    stats.steps.append(plain(batch_sessions=15))
    assert calls() == 3  # the batch
    policy.next_budget(_stats([_step(8, 8, nodes=16, batch_sessions=15)]), 100, "predraft")
    assert len(chosen) == 4 and calls() == 5  # another request's tree, taken into the pool
    costs.observe(15, 15, 1e-3)
    costs.observe(15, 30, 2e-3)
    assert calls() == 6 and calls() == 6  # the costs refitted
    stats.steps.append(_step(4, 1, nodes=8, batch_sessions=15))
    assert calls() == 7  # a tree of its own
    plain_costs = LoadAwarePolicy(StaticPolicy(16, 8), type("Costs", (), {"seconds": lambda self, b, r: 1e-3 + 3e-5 * r})(),
                                  hold_steps=0)
    for _ in range(3):
        plain_costs.next_budget(stats, 100)
    assert len(chosen) == 10


@given(st.floats(0, 1e-2), st.floats(0, 1e-3), st.floats(0, 1e-3))
def test_fit_verify_costs_recovers_exact_costs(base, per_session, per_row):
    truth = VerifyCosts(base, per_session, per_row)
    points = [(b, b * n, truth.seconds(b, b * n)) for b in (1, 8) for n in (1, 8)]
    fitted = fit_verify_costs(points)
    for b, rows, seconds in points:
        assert fitted.seconds(b, rows) == pytest.approx(seconds, rel=1e-6, abs=1e-12)
    assert min(fitted.base, fitted.per_session, fitted.per_row) >= 0



def test_step_costs_follow_the_steps_where_the_verifier_runs():
    """``StepCosts`` refits the start-up profile to the verifier's own steps: where the steps run (16 sessions,
    16-24 rows) its line converges to theirs, the profile's off by 9-15 % there; at other batch sizes it carries
    the correction over in the profile's shape; steps it cannot use (no rows, no time) are ignored, and nothing
    changes before the first refit."""
    profile = VerifyCosts(0.035, 0.001, 0.003)  # SmolLM2's start-up profile: 100 ms for 16 one-row sessions
    truth = VerifyCosts(0.020, 0.0015, 0.0052)  # its steps at 300 positions: 109 ms, 5.2 ms a row
    costs = StepCosts(profile, window=64, refit_every=8)
    rng = np.random.default_rng(0)
    for _ in range(7):
        costs.observe(16, 16, truth.seconds(16, 16))
    assert costs.current is profile and costs.seconds(16, 16) == profile.seconds(16, 16)
    costs.observe(0, 0, 0.1)
    costs.observe(16, 20, 0.0)
    assert costs.observed == 7
    for _ in range(200):
        rows = int(rng.integers(16, 25))
        costs.observe(16, rows, truth.seconds(16, rows) * (1 + rng.normal(0, 0.02)))
    for rows in (16, 20, 24):  # the steps' line, not the profile's
        assert costs.seconds(16, rows) == pytest.approx(truth.seconds(16, rows), rel=0.03)
        assert abs(profile.seconds(16, rows) / truth.seconds(16, rows) - 1) > 0.08
    assert costs.per_row == pytest.approx(truth.per_row, rel=0.1)  # the slope, where the steps vary their rows
    # another batch size: the profile's fixed and per-session parts scaled alike
    assert costs.base / profile.base == pytest.approx(costs.per_session / profile.per_session)
    assert min(costs.base, costs.per_session, costs.per_row) >= 0
    # steps of one size only: the total there from the steps, the split between rows and the rest from the profile
    flat = StepCosts(profile, refit_every=8)
    for _ in range(64):
        flat.observe(16, 16, truth.seconds(16, 16))
    assert flat.seconds(16, 16) == pytest.approx(truth.seconds(16, 16), rel=0.02)
    assert flat.per_row > profile.per_row and flat.base > profile.base  # both parts scaled up
    assert flat.per_row / profile.per_row == pytest.approx(flat.base / profile.base, rel=0.05)
    # a factor beyond MAX_FACTOR is held there
    slow = StepCosts(profile, refit_every=8)
    for rows in range(16, 80):
        slow.observe(16, rows, 10 * truth.seconds(16, rows))
    assert slow.per_row == pytest.approx(MAX_FACTOR * profile.per_row) and slow.base == pytest.approx(
        MAX_FACTOR * profile.base)


@given(st.floats(1e-3, 1e-1), st.floats(0, 1e-2), st.floats(1e-4, 1e-2), st.floats(0.001, 2.0))
def test_refit_costs_with_the_profile_alone_or_its_own_steps_is_the_profile(base, per_session, per_row, weight):
    """The refit's prior is the profile itself: with no steps, or with steps the profile predicts exactly, the
    refit is the profile (up to rounding)."""
    profile = VerifyCosts(base, per_session, per_row)
    steps = [(s, r, profile.seconds(s, r)) for s, r in ((16, 16), (16, 24), (4, 12))]
    for fitted in (refit_costs(profile, [], weight), refit_costs(profile, steps, weight)):
        for sessions, rows in ((1, 1), (8, 64), (16, 20), (64, 64)):
            assert fitted.seconds(sessions, rows) == pytest.approx(profile.seconds(sessions, rows), rel=1e-6)


def test_a_load_aware_policy_reads_the_refitted_costs():
    """The policy holds the ``StepCosts`` the verifier's loop refits: once the steps show rows cost more than the
    profile said, the same acceptance buys a smaller tree (here none)."""
    profile = VerifyCosts(0.035, 0.001, 0.0015)
    costs = StepCosts(profile, refit_every=4)
    policy = LoadAwarePolicy(StaticPolicy(16, 8), costs)
    steps = RequestStats(steps=[_step(6, 2, nodes=16, batch_sessions=16) for _ in range(10)])
    before = policy.next_budget(steps, 100)
    expensive = VerifyCosts(0.03, 0.001, 0.005)
    for i in range(64):
        rows = 16 + 8 * (i % 3)
        costs.observe(16, rows, expensive.seconds(16, rows))
    assert costs.per_row == pytest.approx(expensive.per_row, rel=0.02)
    after = policy.next_budget(steps, 100)
    assert before.max_depth > 0 and after.max_depth == 0


def test_drafting_on_the_verifier_cores_counts_under_load():
    """In one process every session's drafting runs on the verifier's cores: a slow drafter's trees stop paying
    under load, while across processes (its time not the verifier's) the same trees are kept."""
    costs = VerifyCosts(3e-3, 0.2e-3, 0.05e-3)
    steps = [_step(3, 2, nodes=3, draft=0.006, verify=0.02, batch_sessions=16, draft_cpu_seconds=0.006)
             for _ in range(10)]  # 2 ms of CPU per level
    apart = LoadAwarePolicy(StaticPolicy(3, 3), costs).next_budget(RequestStats(steps=steps), 100)
    together = LoadAwarePolicy(StaticPolicy(3, 3), costs, drafting_shares_cores=True).next_budget(
        RequestStats(steps=steps), 100)
    assert apart.max_depth > 0 and together.max_depth == 0


def test_a_drafter_slower_than_the_verifier_stops_drafting_ahead():
    """A pre-draft that the verification's end cuts before its first level (the draft model's forward outlasts the
    target's, as on a GPU where both are host-bound) drafts nothing, yet costs the step a wait for that level:
    its seconds measure a level, and the policy stops drafting ahead; before any such step, the prior's cheap
    drafting keeps it drafting ahead."""
    policy = AdaptivePolicy(max_nodes=4, max_depth=4, probe_every=0)
    plain = [_step(0, 0, verify=0.001, draft=0.0, budget=(4, 4)) for _ in range(8)]
    assert not policy.next_budget(_stats(plain), 100, "predraft").is_zero  # prior: a level is 0.1 verification
    cut = [_step(0, 0, verify=0.001, draft=0.0, budget=(4, 4), predraft_seconds=0.0015, predraft_levels=0)
           for _ in range(8)]
    assert fit_costs(cut).draft_per_level == pytest.approx(0.0015)
    assert policy.next_budget(_stats(cut), 100, "predraft").is_zero
    # a pre-draft that ended before the verification did (nothing to draft) says nothing about a level's cost
    idle = [_step(0, 0, verify=0.001, draft=0.0, budget=(4, 4), predraft_seconds=0.0002, predraft_levels=0)
            for _ in range(8)]
    assert fit_costs(idle).draft_per_level == fit_costs(plain).draft_per_level
