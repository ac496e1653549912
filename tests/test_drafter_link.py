"""The drafter link in-process: failing drafters never change the output, every failure is reported
in the step it happened in, and the drafter taking over is opened with exactly the committed context."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import greedy, make_prompts

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import make_proposer
from orchestrator.drafter_link import DrafterLink
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh.contract import Budget
from specmesh.feedback import TargetFeatures
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

MAX_NEW = 40
PROMPTS = make_prompts(4, seed=31)
VOCAB = 128


class Flaky:
    """A real LocalDrafter that fails in a chosen way from its ``fail_at``-th proposal on."""

    def __init__(self, inner: LocalDrafter, fail_at: int, how: str, log: list) -> None:
        self.inner, self.fail_at, self.how, self.log = inner, fail_at, how, log
        self.calls = 0

    def open(self, session_id, prompt, sampling, prompt_len=None):
        self.log.append(("open", list(prompt)))
        if self.how == "open":
            raise ConnectionError("refused")
        self.inner.open(session_id, prompt, sampling)

    def propose(self, session_id, new_tokens, budget, rollback=0, feedback=None):
        self.calls += 1
        self.log.append(("propose", list(new_tokens)))
        tree = self.inner.propose(session_id, new_tokens, budget, rollback, feedback)
        if self.calls < self.fail_at:
            return tree
        if self.how == "raise":
            raise ConnectionError("drafter died")
        if self.how == "invalid":
            return TokenTree.chain([10**6], source="broken")
        if self.how == "oversize":
            return TokenTree.chain(list(range(budget.max_depth + 2)), source="broken")
        return tree

    def close(self, session_id):
        self.log.append(("close", []))
        self.inner.close(session_id)


def _engine(target, candidates, nodes=8, depth=6, overlap=False) -> Engine:
    return Engine(LocalVerifier(target), candidates,
                  StaticPolicy(nodes, depth, restart_depth=0 if overlap else None), overlap=overlap)


def _errors(result) -> list[str]:
    return [s.draft_error for s in result.stats.steps if s.draft_error]


@pytest.fixture(scope="module")
def parts(model_sets):
    ms = model_sets("random")
    target = ms.runner("target", "fast")
    near = make_proposer("draft_model", draft_runner=ms.runner("near", "fast"))
    lookup = make_proposer("prompt_lookup")
    return target, near, lookup


@settings(max_examples=25)
@given(schedule=st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["raise", "invalid", "oversize", "open",
                                                                        "never"])), min_size=1, max_size=3),
       prompt_index=st.integers(0, len(PROMPTS) - 1), overlap=st.booleans())
def test_any_failure_schedule_keeps_greedy_output(parts, ar_reference, schedule, prompt_index, overlap):
    """Also with overlap: rollbacks of drafted-ahead hypotheses pass through failovers."""
    target, near, lookup = parts
    log: list = []
    candidates = [(f"d{i}", lambda fail_at=fail_at, how=how: Flaky(LocalDrafter(near), fail_at, how, log))
                  for i, (fail_at, how) in enumerate(schedule)]
    candidates.append(("lookup", lambda: LocalDrafter(lookup)))
    prompt = PROMPTS[prompt_index]
    result = _engine(target, candidates, overlap=overlap).generate(prompt, greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", PROMPTS[prompt_index], MAX_NEW)
    # every drafter that took over was opened with the prompt plus everything committed before it
    for kind, tokens in log:
        if kind == "open":
            assert tokens[: len(prompt)] == prompt
            assert tokens[len(prompt):] == result.token_ids[: len(tokens) - len(prompt)]
    # each failure is reported once, naming the drafter, in the order the candidates were tried
    failed = [e.split(":")[0] for e in "; ".join(_errors(result)).split("; ") if not e.startswith("no drafter")]
    assert failed == sorted(set(failed))


def test_failures_are_reported_in_their_step_and_the_next_drafter_resumes(parts, ar_reference):
    target, near, lookup = parts
    log: list = []
    first = Flaky(LocalDrafter(near), 3, "raise", log)
    result = _engine(target, [("first", lambda: first), ("lookup", lambda: LocalDrafter(lookup))]).generate(
        PROMPTS[0], greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", PROMPTS[0], MAX_NEW)
    assert _errors(result) == ["first: ConnectionError: drafter died"]
    failed_step = next(i for i, s in enumerate(result.stats.steps) if s.draft_error)
    assert failed_step == 2 and result.stats.steps[failed_step].num_proposed == 0  # verified without a tree
    assert first.calls == 3 and ("close", []) in log
    # prompt lookup drafts from the next step on (the context repeats: it finds matches)
    assert any(s.num_proposed for s in result.stats.steps[failed_step + 1:])


def test_all_drafters_failing_falls_back_to_plain_decoding(parts, ar_reference):
    target, near, _ = parts
    log: list = []
    result = _engine(target, [(f"d{i}", lambda: Flaky(LocalDrafter(near), 2, "raise", log)) for i in range(2)]
                     ).generate(PROMPTS[1], greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", PROMPTS[1], MAX_NEW)
    assert _errors(result) == ["d0: ConnectionError: drafter died",
                               "d1: ConnectionError: drafter died; no drafter left: decoding without drafts"]
    assert all(s.num_proposed == 0 for s in result.stats.steps[-3:])  # plain decoding after that


def test_a_failed_step_is_verified_without_a_tree_and_the_next_drafter_drafts_from_the_next(parts):
    """No retry within the step: the next drafter (its connect, its prefill) starts with the next step."""
    _, near, lookup = parts
    log: list = []
    committed: list[int] = []
    link = DrafterLink([("first", lambda: Flaky(LocalDrafter(near), 1, "raise", log)),
                        ("lookup", lambda: LocalDrafter(lookup))], "s", VOCAB, committed, background=False)
    link.open([5, 6, 7, 5, 6], greedy(10))
    link.wait_open()
    tree, _ = link.draft(Budget(4, 4, deadline=time.monotonic() + 10))
    assert tree.num_nodes == 0 and link.take_errors() == "first: ConnectionError: drafter died"
    committed.append(7)
    tree, _ = link.draft(Budget(4, 4))
    assert tree.tokens.tolist()[:1] == [5]  # prompt lookup continues "5 6 7" -> "5 ..."
    link.close(len(committed))


def test_a_tree_breaking_the_budget_fails_over(parts):
    _, near, lookup = parts
    log: list = []
    link = DrafterLink([("first", lambda: Flaky(LocalDrafter(near), 1, "oversize", log)),
                        ("lookup", lambda: LocalDrafter(lookup))], "s", VOCAB, [], background=True)
    link.open([5, 6, 7, 5, 6, 7], greedy(10))
    link.wait_open()
    tree, _ = link.collect(link.start(Budget(8, 3)))
    assert tree is None and link.take_errors() == "first: InvalidTreeError: tree depth 5 exceeds the limit 3"
    tree, _ = link.draft(Budget(4, 3))
    assert tree.num_nodes > 0 and set(tree.sources) == {"prompt_lookup"}
    link.close(0)


def test_context_sync_at_close_on_a_dead_drafter_opens_no_other_replica():
    """The zero-budget sync before close is best effort: a failure there closes the drafter, and no
    further replica is opened (it would only prefill to be closed at once)."""
    log: list = []
    first = Flaky(LocalDrafter(make_proposer("prompt_lookup")), fail_at=1, how="raise", log=log)
    second = Flaky(LocalDrafter(make_proposer("prompt_lookup")), fail_at=10**9, how="raise", log=log)
    committed: list[int] = []
    link = DrafterLink([("a", lambda: first), ("b", lambda: second)], "s", VOCAB, committed, background=True)
    link.open([1, 2, 3], greedy(8))
    link.wait_open()
    committed.append(4)
    link.close(len(committed))
    assert ("propose", [4]) in log  # the sync was tried
    assert [e for e in log if e[0] != "propose"] == [("open", [1, 2, 3]), ("close", [])]  # b was never opened
    assert not link.active


def test_features_go_to_the_drafter_only_inside_the_context_it_holds():
    """A drafter refuses feature rows of positions past its context; a stop may cut the last step, so the sync
    before close sends only the rows of the emitted context (here 3 prompt + 2 emitted tokens: positions 0..4)."""
    sent = []

    class Recording(LocalDrafter):
        def propose(self, session_id, new_tokens, budget, rollback=0, feedback=None):
            sent.append(feedback)
            return super().propose(session_id, new_tokens, budget, rollback, feedback)

    committed: list[int] = []
    link = DrafterLink([("rec", lambda: Recording(make_proposer("prompt_lookup")))], "s", VOCAB, committed,
                       background=False)
    link.open([1, 2, 3], greedy(8))
    link.wait_open()
    committed += [4, 5, 6, 7]  # one verification: pending (position 3) + 3 accepted, and the bonus
    link.add_features(TargetFeatures(0, np.ones((3, 8), np.float32)))  # the prompt's
    link.add_features(TargetFeatures(3, np.full((4, 8), 2.0, np.float32)))  # the pending and accepted rows
    link.add_features(TargetFeatures(7, np.full((1, 8), 3.0, np.float32)))
    link.close(2)  # a stop string ended the output after 2 of the 4 tokens
    (feedback,) = sent
    assert feedback.committed_len == 5
    assert [(f.start, len(f)) for f in feedback.features] == [(0, 3), (3, 2)]
    assert (feedback.features[1].rows == 2.0).all()
