"""A drafter can be wrong, broken or dead; a request can be bad.

A broken drafter never changes the output (exactly the AR greedy tokens) nor fails the
request, and the failure is visible in the stats. Bad prompts get a ValueError with a
clear message, and the engine keeps serving other requests afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_helpers import MAX_POSITIONS, VOCAB, drafter_of, engine_for, greedy, make_prompts

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import DraftSessionState, Proposer, make_proposer
from orchestrator.drafter_link import only
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh.contract import Budget, UnknownSessionError
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from verifier_service.verifier import LocalVerifier

MAX_NEW = 24
PROMPTS = make_prompts(4, seed=9)


class FlakyProposer(Proposer):
    """Wraps a real proposer; raises (or returns ``bad_tree``) on the ``fail_at``-th call."""

    def __init__(self, inner, fail_at: int = 2, exc: Exception | None = None, bad_tree=None) -> None:
        self.inner, self.fail_at, self.exc, self.bad_tree = inner, fail_at, exc, bad_tree
        self.name = "flaky"
        self.calls = 0

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        self.calls += 1
        tree = self.inner.propose(state, budget)
        if self.calls == self.fail_at:
            if self.exc is not None:
                raise self.exc
            return self.bad_tree(tree) if callable(self.bad_tree) else self.bad_tree
        return tree

    def release(self, state: DraftSessionState) -> None:
        self.inner.release(state)


def _tree(tokens, parents, probs=None, **kw) -> TokenTree:
    n = len(tokens)
    return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64),
                     np.asarray(probs if probs is not None else np.ones(n), np.float64), ("bad",) * n, **kw)


BAD_TREES = {
    "out_of_vocab": _tree([3, VOCAB + 5], [-1, 0]),
    "negative_token": _tree([3, -4], [-1, 0]),
    "parent_is_self": _tree([3, 4], [-1, 1]),
    "parent_forward": _tree([3, 4, 5], [-1, 2, 0]),
    "parent_below_root": _tree([3, 4], [-1, -7]),
    "nan_prob": _tree([3, 4], [-1, 0], [0.5, float("nan")]),
    "ragged_arrays": TokenTree(np.asarray([3, 4], np.int64), np.asarray([-1], np.int64), np.ones(2)),
    "too_many_nodes": _tree([5] * 300, [-1] * 300),  # above the verifier's 256-node limit
    "float_parents": TokenTree(np.asarray([3, 4], np.int64), np.asarray([-1.0, 0.5]), np.ones(2)),
    "bad_q": _tree([3], [-1], q_cu=np.asarray([0, 1], np.int64), q_ids=np.asarray([4], np.int64), q_probs=np.ones(1)),
}


def _near(model_sets):
    ms = model_sets("random")
    return ms.runner("target", "hf"), ms.runner("near", "hf")


@pytest.mark.parametrize("fail_at", [1, 3])
def test_drafter_that_raises(model_sets, ar_reference, fail_at):
    target, draft = _near(model_sets)
    for prompt in PROMPTS:
        flaky = FlakyProposer(make_proposer("draft_model_tree", draft_runner=draft), fail_at, RuntimeError("draft GPU fell off"))
        engine = engine_for(target, flaky, 8, 4, strict=False)
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", "hf", prompt, MAX_NEW)
        assert res.finish_reason == "length"
        assert res.stats.num_draft_errors == 1
        bad = [s for s in res.stats.steps if s.draft_error]
        assert "RuntimeError" in bad[0].draft_error and "draft GPU fell off" in bad[0].draft_error
        # that step and every later one was plain decoding: the drafter was dropped
        idx = res.stats.steps.index(bad[0])
        assert all(s.num_proposed == 0 for s in res.stats.steps[idx:])
        assert flaky.calls == fail_at
        assert drafter_of(engine)._sessions == {} and engine.verifier.num_sessions == 0


@pytest.mark.parametrize("name", list(BAD_TREES))
def test_drafter_returning_an_invalid_tree(model_sets, ar_reference, name):
    target, draft = _near(model_sets)
    for prompt in PROMPTS[:2]:
        flaky = FlakyProposer(make_proposer("draft_model", draft_runner=draft), 2, bad_tree=BAD_TREES[name])
        engine = engine_for(target, flaky, 8, 4, strict=False)
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", "hf", prompt, MAX_NEW)
        assert res.stats.num_draft_errors == 1
        assert "InvalidTreeError" in next(s.draft_error for s in res.stats.steps if s.draft_error)
        assert engine.verifier.num_sessions == 0


@pytest.mark.parametrize("fault", ["raises", "too_many_nodes", "out_of_vocab"])
def test_strict_engines_surface_drafter_bugs(model_sets, fault):
    """The suite's engines are strict: a proposer bug fails the request instead of hiding behind the fallback
    to plain decoding (whose output is identical, so equality tests alone could not see it)."""
    target, draft = _near(model_sets)
    inner = make_proposer("draft_model", draft_runner=draft)
    flaky = (FlakyProposer(inner, 2, RuntimeError("a proposer bug")) if fault == "raises"
             else FlakyProposer(inner, 2, bad_tree=BAD_TREES[fault]))
    engine = engine_for(target, flaky, 8, 4)
    with pytest.raises(RuntimeError if fault == "raises" else InvalidTreeError):
        engine.generate(PROMPTS[0], greedy(MAX_NEW))
    assert engine.verifier.num_sessions == 0 and drafter_of(engine)._sessions == {}


def test_drafter_returning_an_invalid_tree_while_sampling(model_sets):
    """Sampling requests fall back the same way (the tree's draft distribution is malformed)."""
    target, draft = _near(model_sets)
    flaky = FlakyProposer(make_proposer("draft_model", draft_runner=draft), 1, bad_tree=BAD_TREES["bad_q"])
    engine = engine_for(target, flaky, 8, 4, strict=False)
    res = engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_new_tokens=MAX_NEW, ignore_eos=True))
    assert len(res.token_ids) == MAX_NEW and res.stats.num_draft_errors == 1


def test_drafter_ignoring_its_budget_near_the_context_limit(model_sets, ar_reference):
    """A drafter that returns a deeper tree than it was asked for is a wrong drafter, not a failed request.

    The prompt fills the context up to exactly max_new_tokens, so an over-deep tree runs past
    the model's positions at the end of the request.
    """
    target, _ = _near(model_sets)
    base = PROMPTS[0]
    prompt = (base * (MAX_POSITIONS // len(base) + 1))[: MAX_POSITIONS - MAX_NEW]

    class Greedy8(Proposer):  # proposes 8 tokens whatever the budget says
        name = "greedy8"

        def propose(self, state, budget):
            return TokenTree.chain([5] * 8, source=self.name)

    expected = engine_for(target).generate(prompt, greedy(MAX_NEW)).token_ids
    res = engine_for(target, Greedy8(), 4, 2, strict=False).generate(prompt, greedy(MAX_NEW))
    assert res.token_ids == expected
    assert res.stats.num_draft_errors >= 1  # the oversize tree is reported, not silently verified


@pytest.mark.parametrize("proposer", ["draft_model", "draft_model_tree"])
def test_drafter_past_its_deadline_returns_a_partial_tree(model_sets, ar_reference, proposer):
    """A deadline that is already over when drafting starts: the draft model stops after one level."""
    target, draft = _near(model_sets)
    engine = Engine(LocalVerifier(target), only(LocalDrafter(make_proposer(proposer, draft_runner=draft))),
                    StaticPolicy(8, 6, draft_timeout_s=1e-9))
    for prompt in PROMPTS[:2]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ar_reference("random", "hf", prompt, MAX_NEW)
        assert all(s.tree_depth <= 1 for s in res.stats.steps) and res.stats.num_draft_errors == 0


class _DeadDrafter:
    """A Drafter whose transport is down: ``fail`` names the methods that raise."""

    def __init__(self, inner: LocalDrafter, fail: set[str]) -> None:
        self.inner, self.fail = inner, fail

    def _maybe(self, what):
        if what in self.fail:
            raise ConnectionError(f"drafter unreachable during {what}")

    def open(self, session_id, prompt, sampling, prompt_len=None):
        self._maybe("open")
        self.inner.open(session_id, prompt, sampling)

    def propose(self, session_id, new_tokens, budget, rollback=0, feedback=None):
        self._maybe("propose")
        return self.inner.propose(session_id, new_tokens, budget, rollback, feedback)

    def close(self, session_id):
        self._maybe("close")
        self.inner.close(session_id)


@pytest.mark.parametrize(
    "fail", [{"propose"}, {"propose", "close"}, {"open"}, {"close"}], ids=["propose", "propose+close", "open", "close"]
)
def test_unreachable_drafter_never_fails_the_request(model_sets, ar_reference, fail):
    target, draft = _near(model_sets)
    drafter = _DeadDrafter(LocalDrafter(make_proposer("draft_model", draft_runner=draft)), fail)
    engine = Engine(LocalVerifier(target), only(drafter), StaticPolicy(4, 4))
    prompt = PROMPTS[1]
    res = engine.generate(prompt, greedy(MAX_NEW))  # must not raise
    assert res.token_ids == ar_reference("random", "hf", prompt, MAX_NEW)
    assert res.finish_reason == "length"
    if fail & {"open", "propose"}:
        assert res.stats.num_draft_errors >= 1  # visible in the stats
    assert engine.verifier.num_sessions == 0


# ------------------------------------------------------------------ bad input
BAD_PROMPTS = {
    "empty": ([], "at least one token"),
    "out_of_vocab": ([1, 2, VOCAB], r"\[0, 128\)"),
    "negative": ([1, -1, 2], r"\[0, 128\)"),
    "too_long": ([1] * (MAX_POSITIONS - MAX_NEW + 1), "exceeds"),
}


@pytest.mark.parametrize("proposer", [None, "draft_model", "prompt_lookup"])
@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompt_is_a_clear_value_error(model_sets, ar_reference, name, proposer):
    target, draft = _near(model_sets)
    engine = engine_for(target, proposer, 4, 4, draft_runner=draft)
    prompt, message = BAD_PROMPTS[name]
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, greedy(MAX_NEW))
    assert engine.verifier.num_sessions == 0
    if drafter_of(engine) is not None:
        assert drafter_of(engine)._sessions == {}
    # and the engine keeps serving
    assert engine.generate(PROMPTS[0], greedy(MAX_NEW)).token_ids == ar_reference("random", "hf", PROMPTS[0], MAX_NEW)


def test_longest_allowed_prompt_is_served(model_sets):
    target, draft = _near(model_sets)
    prompt = [7, 8, 9] * ((MAX_POSITIONS - MAX_NEW) // 3) + [7] * ((MAX_POSITIONS - MAX_NEW) % 3)
    assert len(prompt) + MAX_NEW == MAX_POSITIONS
    ref = engine_for(target).generate(prompt, greedy(MAX_NEW)).token_ids
    for proposer in ("draft_model", "draft_model_tree", "prompt_lookup_tree"):
        res = engine_for(target, proposer, 12, 6, draft_runner=draft).generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == ref, proposer


def test_verifier_rejects_unknown_and_duplicate_sessions(model_sets):
    target, _ = _near(model_sets)
    verifier = LocalVerifier(target)
    with pytest.raises(UnknownSessionError):
        verifier.verify("nope", TokenTree.empty())
    verifier.prefill("s", [1, 2, 3], greedy(4))
    with pytest.raises(ValueError, match="already exists"):
        verifier.prefill("s", [1, 2, 3], greedy(4))
    verifier.release("s")
    verifier.release("s")  # idempotent
    assert verifier.num_sessions == 0


# ------------------------------------------------------------ request isolation
def test_client_disconnect_releases_sessions(model_sets):
    target, draft = _near(model_sets)
    engine = engine_for(target, "draft_model", 4, 4, draft_runner=draft)
    stream = engine.stream(PROMPTS[0], greedy(MAX_NEW))
    next(stream)
    next(stream)
    assert engine.verifier.num_sessions == 1 and len(drafter_of(engine)._sessions) == 1
    stream.close()  # the client went away mid-request
    assert engine.verifier.num_sessions == 0 and drafter_of(engine)._sessions == {}


@pytest.mark.parametrize("proposer", [None, "draft_model"])
def test_unseeded_sampling_leaves_the_global_torch_rng_alone(model_sets, proposer):
    """A request without a seed must draw its own entropy, not re-seed the process-wide torch RNG
    (which would silently change every other user of torch.manual_seed in the process)."""
    target, draft = _near(model_sets)
    engine = engine_for(target, proposer, 4, 4, draft_runner=draft)
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    assert torch.equal(torch.rand(4), expected)
