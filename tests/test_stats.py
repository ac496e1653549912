"""Request statistics: τ, acceptance per position, per-source counts, forwards per token."""

from __future__ import annotations

import pytest
from spec_helpers import OracleProposer, engine_for, greedy, make_prompts

from orchestrator.stats import RequestStats, StepStats


def _step(proposed, depth, accepted, sources=("a",), error=""):
    src = tuple(sources[i % len(sources)] for i in range(proposed))
    return StepStats(proposed, depth, accepted, src[:accepted], src, 0.0, 0.0, error)


def test_stats_formulas_on_known_steps():
    stats = RequestStats(num_generated=11)
    stats.steps = [_step(4, 4, 4), _step(4, 4, 0), _step(6, 3, 2, ("a", "b")), _step(0, 0, 0, error="x")]
    assert stats.tau == pytest.approx((5 + 1 + 3 + 1) / 4)
    accepted, reached = stats.position_counts()
    assert reached == [3, 3, 3, 2] and accepted == [2, 2, 1, 1]
    assert stats.acceptance_per_position() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 2])
    assert stats.target_forwards_per_token == pytest.approx(5 / 11)
    assert stats.num_draft_errors == 1
    assert stats.per_source() == {"a": {"proposed": 11, "accepted": 5}, "b": {"proposed": 3, "accepted": 1}}


def test_stats_of_real_requests_are_consistent(model_sets, ar_reference):
    """Oracle drafter: everything on the true path is accepted, so per-position acceptance is 1 and
    committed tokens add up to the output length."""
    ms = model_sets("random")
    runner = ms.runner("target", "fast")
    prompts = make_prompts(3, seed=21)
    seqs = [p + ar_reference("random", "fast", p, 20) for p in prompts]
    engine = engine_for(runner, OracleProposer(seqs, decoys=0), 4, 4)
    for p in prompts:
        stats = engine.generate(p, greedy(20)).stats
        assert stats.num_generated == 20 == 1 + sum(s.num_accepted + 1 for s in stats.steps)
        assert all(a == 1.0 for a in stats.acceptance_per_position())
        assert stats.per_source()["oracle"]["accepted"] == sum(s.num_accepted for s in stats.steps)
        assert stats.target_forwards_per_token == pytest.approx((1 + stats.num_steps) / 20)
        summary = stats.summary()
        assert summary["tau"] == stats.tau and summary["draft_errors"] == 0
