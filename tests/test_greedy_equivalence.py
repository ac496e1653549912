"""Greedy speculative decoding == autoregressive greedy decoding, token for token.

For every registered proposer, chain and tree budgets and both model runners (the
draft-model proposers on a plain random target with a noisy copy of it as draft, the
copy-based ones on a target whose greedy text loops so prompt lookup gets accepted),
with an always-accept drafter (draft == target, and an oracle that hides the true path
behind decoy siblings) and always-reject drafters (an unrelated model, a wrong oracle).
"""

from __future__ import annotations

import itertools

import pytest
from spec_helpers import (
    BACKENDS,
    ContextRecorder,
    OracleProposer,
    RecordingVerifier,
    check_drafter_contexts,
    check_greedy_steps,
    engine_for,
    greedy,
    make_prompts,
    naive_greedy,
    window_for,
)

from drafter_service.proposer import make_proposer, proposer_names

BUDGETS = [(1, 1), (4, 4), (12, 5), (24, 8)]
NUM_PROMPTS = 20
MAX_NEW = 24
PROMPTS = make_prompts(NUM_PROMPTS, seed=1)


def _budget_id(b):
    return f"{b[0]}x{b[1]}"


# ------------------------------------------------------------- the AR baseline
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["random", "cyclic"])
def test_ar_engine_matches_naive_full_recompute(model_sets, ar_reference, kind, backend):
    """The cached AR engine equals recomputing the whole sequence with the HF model each step."""
    target = model_sets(kind).target
    for prompt in PROMPTS[:4]:
        assert ar_reference(kind, backend, prompt, MAX_NEW) == naive_greedy(target, prompt, MAX_NEW)


def test_ar_outputs_are_not_degenerate(model_sets, ar_reference):
    """Guards the other tests from passing vacuously on a model that repeats one token."""
    for kind in ("random", "cyclic"):
        outs = [ar_reference(kind, "hf", p, MAX_NEW) for p in PROMPTS]
        assert all(len(o) == MAX_NEW for o in outs)
        assert sum(len(set(o)) for o in outs) / len(outs) > 8, kind
        assert len({tuple(o) for o in outs}) == len(outs), kind


# ------------------------------------------------- every proposer, every budget
def _kind(proposer: str) -> str:
    # model-based drafts on the plain random target; copy-based ones where the text loops
    return "random" if proposer.startswith("draft_model") else "cyclic"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", BUDGETS, ids=_budget_id)
@pytest.mark.parametrize("proposer", proposer_names())
def test_speculative_greedy_equals_ar(model_sets, ar_reference, proposer, budget, backend):
    """Half the prompts per case: 14 proposers x 4 budgets x 2 runners already sweep the shapes."""
    kind = _kind(proposer)
    ms = model_sets(kind)
    target = ms.runner("target", backend)
    recorder = ContextRecorder(make_proposer(proposer, draft_runner=ms.runner("near", backend)))
    verifier = RecordingVerifier(target, feedback_topk=recorder.feedback_topk, lookahead=window_for(recorder))
    engine = engine_for(target, recorder, *budget, verifier=verifier)
    accepted = 0
    for i, prompt in enumerate(PROMPTS[:NUM_PROMPTS // 2]):
        verifier.log.clear()
        recorder.contexts.clear()
        res = engine.generate(prompt, greedy(MAX_NEW))
        expected = ar_reference(kind, backend, prompt, MAX_NEW)
        assert res.token_ids == expected, f"prompt {i}"
        # the verifier accepted the longest path that follows the target, no more, no less
        check_greedy_steps(verifier.log, prompt, expected + [-1] * 10)
        # the drafter was always told exactly what was committed
        check_drafter_contexts(recorder.contexts, verifier.log, prompt, expected + [-1] * 10)
        assert res.finish_reason == "length"
        assert res.stats.num_draft_errors == 0, [s.draft_error for s in res.stats.steps if s.draft_error]
        for s in res.stats.steps:
            assert s.num_proposed <= budget[0] and s.tree_depth <= budget[1]
            assert s.num_accepted <= s.tree_depth
        accepted += sum(s.num_accepted for s in res.stats.steps)
    assert accepted > 0  # not vacuous: speculation happened and was (partly) accepted


# ------------------------------------------------------------ always accept
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", BUDGETS, ids=_budget_id)
def test_draft_equal_to_target_chain_accepts_everything(model_sets, ar_reference, budget, backend):
    ms = model_sets("random")
    engine = engine_for(ms.runner("target", backend), "draft_model", *budget, draft_runner=ms.runner("same", backend))
    for prompt in PROMPTS[:8]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", backend, prompt, MAX_NEW)
        steps = res.stats.steps
        assert all(s.num_accepted == s.tree_depth for s in steps), [(s.num_accepted, s.tree_depth) for s in steps]
        assert res.stats.tau == pytest.approx(_tau_if_all_accepted(*budget))


def _tau_if_all_accepted(max_nodes: int, max_depth: int) -> float:
    """τ of a chain drafter whose every token is accepted, under StaticPolicy's end-of-request clipping."""
    remaining, commits = MAX_NEW - 1, []
    while remaining > 0:
        depth = min(max_depth, remaining - 1)
        commits.append(min(max_nodes, depth) + 1)
        remaining -= commits[-1]
    return sum(commits) / len(commits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", BUDGETS[1:], ids=_budget_id)
def test_draft_equal_to_target_tree_accepts_greedy_path(model_sets, ar_reference, budget, backend):
    ms = model_sets("random")
    engine = engine_for(ms.runner("target", backend), "draft_model_tree", *budget, draft_runner=ms.runner("same", backend))
    taus = []
    for prompt in PROMPTS[:8]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", backend, prompt, MAX_NEW)
        # the draft's top child at the root is the target's argmax: at least one token per step
        assert all(s.num_accepted >= 1 for s in res.stats.steps if s.tree_depth >= 1)
        taus.append(res.stats.tau)
    assert sum(taus) / len(taus) >= 2.0, taus


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [(3, 1), (7, 3), (12, 5), (40, 8)], ids=_budget_id)
def test_oracle_tree_with_decoy_siblings(model_sets, ar_reference, budget, backend):
    """The true path sits behind wrong siblings: it must be found, and the compacted cache must stay right."""
    ms = model_sets("random")
    runner = ms.runner("target", backend)
    seqs = [p + ar_reference("random", backend, p, MAX_NEW) for p in PROMPTS]
    verifier = RecordingVerifier(runner)
    engine = engine_for(runner, OracleProposer(seqs), *budget, verifier=verifier)
    gathered = 0
    for prompt in PROMPTS:
        verifier.log.clear()
        res = engine.generate(prompt, greedy(MAX_NEW))
        expected = ar_reference("random", backend, prompt, MAX_NEW)
        assert res.token_ids == expected
        check_greedy_steps(verifier.log, prompt, expected)  # the whole true path, every step
        assert all(r.num_accepted >= 1 for t, r in verifier.log if t.num_nodes)
        gathered += sum(r.accepted_nodes != tuple(range(r.num_accepted)) for _, r in verifier.log)
        assert res.stats.tau > 1.5
    assert gathered > 0  # the accepted path was not a prefix of the node list: the cache had to gather


# ------------------------------------------------------------- always reject
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("proposer", ["draft_model", "draft_model_tree"])
def test_unrelated_draft_model_is_rejected_but_output_unchanged(model_sets, ar_reference, proposer, backend):
    ms = model_sets("random")
    engine = engine_for(ms.runner("target", backend), proposer, 12, 5, draft_runner=ms.runner("other", backend))
    proposed = accepted = 0
    for prompt in PROMPTS:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", backend, prompt, MAX_NEW)
        proposed += sum(s.num_proposed for s in res.stats.steps)
        accepted += sum(s.num_accepted for s in res.stats.steps)
    assert proposed > 0 and accepted / proposed < 0.1


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_oracle_accepts_nothing(model_sets, ar_reference, backend):
    ms = model_sets("random")
    seqs = [p + ar_reference("random", backend, p, MAX_NEW) for p in PROMPTS]
    engine = engine_for(ms.runner("target", backend), OracleProposer(seqs, wrong=True), 12, 5)
    for prompt in PROMPTS[:10]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", backend, prompt, MAX_NEW)
        assert res.stats.tau == 1.0
        assert res.stats.num_steps == MAX_NEW - 1


# -------------------------------------------------------- concurrent sessions
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("proposer", ["draft_model_tree", "prompt_lookup_tree"])
def test_interleaved_sessions_do_not_interfere(model_sets, ar_reference, proposer, backend):
    """Several requests stepped round-robin on one verifier/drafter pair keep their own caches."""
    ms = model_sets("cyclic")
    engine = engine_for(ms.runner("target", backend), proposer, 12, 5, draft_runner=ms.runner("near", backend))
    prompts = PROMPTS[:6]
    outs = [[] for _ in prompts]
    streams = [engine.stream(p, greedy(MAX_NEW)) for p in prompts]
    for events in itertools.zip_longest(*streams):
        for i, ev in enumerate(events):
            if ev is not None:
                outs[i] += ev.tokens
    assert engine.verifier.num_sessions == 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == ar_reference("cyclic", backend, prompt, MAX_NEW)
