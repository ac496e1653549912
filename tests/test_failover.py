"""FailoverDrafter in-process: failing drafters never change the output, and the drafter
taking over is opened with exactly the committed context."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import greedy, make_prompts

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import Budget, make_proposer
from orchestrator.engine import Engine
from orchestrator.failover import AllDraftersFailed, FailoverDrafter
from orchestrator.policy import StaticPolicy
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

MAX_NEW = 40
PROMPTS = make_prompts(4, seed=31)


class Flaky:
    """A real LocalDrafter that fails in a chosen way from its ``fail_at``-th proposal on."""

    def __init__(self, inner: LocalDrafter, fail_at: int, how: str, log: list) -> None:
        self.inner, self.fail_at, self.how, self.log = inner, fail_at, how, log
        self.calls = 0

    def open(self, session_id, prompt, sampling):
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
        self.inner.close(session_id)


def _engine(target, drafter, nodes=8, depth=6, overlap=False) -> Engine:
    return Engine(LocalVerifier(target), drafter, StaticPolicy(nodes, depth, restart_depth=0 if overlap else None),
                  overlap=overlap)


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
    drafter = FailoverDrafter(candidates, vocab_size=target.info.vocab_size)
    prompt = PROMPTS[prompt_index]
    result = _engine(target, drafter, overlap=overlap).generate(prompt, greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", prompt, MAX_NEW)
    # every drafter that took over was opened with the prompt plus everything committed before it
    # (with overlap, plus the hypothesis being drafted ahead on, which may be rolled back later)
    for kind, tokens in log:
        if kind == "open":
            assert tokens[: len(prompt)] == prompt
            if not overlap:
                assert tokens[len(prompt):] == result.token_ids[: len(tokens) - len(prompt)]


def test_failures_are_reported_and_the_next_drafter_resumes(parts, ar_reference):
    target, near, lookup = parts
    log, failures = [], []
    first = Flaky(LocalDrafter(near), 3, "raise", log)
    drafter = FailoverDrafter([("first", lambda: first), ("lookup", lambda: LocalDrafter(lookup))],
                              target.info.vocab_size, lambda session, message: failures.append(message))
    result = _engine(target, drafter).generate(PROMPTS[0], greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", PROMPTS[0], MAX_NEW)
    assert failures == ["first: ConnectionError: drafter died"]
    assert all(not s.draft_error for s in result.stats.steps)  # a failover is not a lost step
    assert first.calls == 3


def test_all_drafters_failing_falls_back_to_plain_decoding(parts, ar_reference):
    target, near, _ = parts
    log: list = []
    drafter = FailoverDrafter([(f"d{i}", lambda: Flaky(LocalDrafter(near), 2, "raise", log)) for i in range(2)],
                              target.info.vocab_size)
    result = _engine(target, drafter).generate(PROMPTS[1], greedy(MAX_NEW))
    assert result.token_ids == ar_reference("random", "fast", PROMPTS[1], MAX_NEW)
    errors = [s.draft_error for s in result.stats.steps if s.draft_error]
    assert len(errors) == 1 and AllDraftersFailed.__name__ in errors[0]
    assert all(s.num_proposed == 0 for s in result.stats.steps[-3:])  # plain decoding after that


def test_a_failure_past_the_deadline_skips_the_step_instead_of_retrying(parts):
    _, near, lookup = parts
    log: list = []
    drafter = FailoverDrafter([("first", lambda: Flaky(LocalDrafter(near), 1, "raise", log)),
                               ("lookup", lambda: LocalDrafter(lookup))])
    drafter.open("s", [5, 6, 7, 5, 6], greedy(10))
    expired = Budget(4, 4, deadline=time.monotonic() - 1)
    assert drafter.propose("s", [7], expired).num_nodes == 0  # no time left for the next drafter this step
    assert drafter.current("s") == "lookup"
    tree = drafter.propose("s", [], Budget(4, 4))
    assert tree.tokens.tolist()[:1] == [5]  # prompt lookup continues "5 6 7" -> "5 ..."


def test_context_sync_at_close_on_a_dead_drafter_opens_no_other_replica():
    """The zero-budget sync before close is best effort: a failure there is recorded, the drafter
    closed, and no further replica is opened (it would only prefill to be closed at once)."""
    log: list = []
    first = Flaky(LocalDrafter(make_proposer("prompt_lookup")), fail_at=1, how="raise", log=log)
    second = Flaky(LocalDrafter(make_proposer("prompt_lookup")), fail_at=10**9, how="raise", log=log)
    failover = FailoverDrafter([("a", lambda: first), ("b", lambda: second)])
    failover.open("s", [1, 2, 3], greedy(8))
    assert failover.propose("s", [4], Budget(0, 0)).num_nodes == 0
    assert [e for e in log if e[0] == "open"] == [("open", [1, 2, 3])]  # b was never opened
    assert failover.current("s") is None and "drafter died" in failover.errors("s")[0]
    failover.close("s")
