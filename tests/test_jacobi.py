"""Jacobi decoding as a proposer (drafter_service/jacobi.py): the window is one Jacobi iteration per
verification, kept by absolute position; greedy output equals plain decoding in process, with PEARL overlap,
and the guesses converge to the target's greedy continuation."""

from __future__ import annotations

import numpy as np

from drafter_service.jacobi import JacobiProposer, JacobiSession, learn_successors, record_iteration, window
from drafter_service.proposer import DraftSessionState
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback, VerifyFeedback
from specmesh.sampling import SamplingParams
from tests.spec_helpers import engine_for, greedy


def test_window_fills_by_bigram_lookup_before_any_prediction():
    session = JacobiSession()
    tokens = [5, 6, 7, 5, 6]
    learn_successors(session, tokens)
    # after 6 came 7, after 7 came 5, ...: the fill copies the context's most recent continuation
    assert window(session, tokens, 4) == [7, 5, 6, 7]
    assert window(session, [*tokens, 9], 2) == [9, 9]  # a token never followed by anything: repeated


def test_an_iteration_moves_the_targets_predictions_into_the_window_by_position():
    session = JacobiSession()
    tokens = [1, 2, 3]  # pending token 3 at position 2
    learn_successors(session, tokens)
    chain = window(session, tokens, 3)
    session.proposals.append((len(tokens), chain))
    # the verifier ran rows [3, *chain]; the target predicted 10 after 3, 11 after chain[0], ...
    assert record_iteration(session, [3, *chain], [10, 11, 12, 13], tokens)
    assert session.guesses == {3: 10, 4: 11, 5: 12, 6: 13}
    # nothing accepted: the bonus 10 is committed at position 3, the next window is the target's guesses
    tokens = [1, 2, 3, 10]
    assert window(session, tokens, 3)[:3] == [11, 12, 13]
    # rows that are not one of our drafts change nothing
    assert not record_iteration(session, [3, 99, 98], [1, 2, 3], tokens)


def test_at_the_fixed_point_every_step_commits_the_whole_window(model_sets, ar_reference):
    """A target whose greedy text loops, with the loop already in the context: the window (the context's
    continuation, then the target's own predictions) is the fixed point, and every step commits all of it
    plus the bonus. Before that (a fresh prompt) vanilla Jacobi commits about one token per step."""
    target = model_sets("cyclic").runner("target", "fast")
    base = [3, 1, 4, 1, 5, 9, 2, 6]
    fresh = engine_for(target, "jacobi", 6, 6).generate(base, greedy(24))
    assert fresh.token_ids == ar_reference("cyclic", "fast", base, 24)
    prompt = base + fresh.token_ids
    result = engine_for(target, "jacobi", 6, 6).generate(prompt, greedy(22))  # (the loop breaks ~30 later)
    assert result.token_ids == ar_reference("cyclic", "fast", prompt, 22)
    assert [s.num_accepted for s in result.stats.steps] == [6, 6, 6]  # 22 = the prefill's token + 3 x 7


def test_greedy_equals_plain_decoding_with_and_without_overlap(demo_stack):
    prompt = demo_stack.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    plain = demo_stack.engine(None).generate(prompt, SamplingParams(max_new_tokens=48)).token_ids
    for overlap in (False, True):
        result = demo_stack.engine("jacobi", overlap=overlap).generate(prompt, SamplingParams(max_new_tokens=48))
        assert result.token_ids == plain, overlap
        assert result.stats.num_draft_errors == 0
        assert result.stats.num_steps < len(plain)  # the window was accepted, at least once


def test_observe_forgets_settled_positions():
    proposer = JacobiProposer()
    state = DraftSessionState("s", [1, 2, 3], SamplingParams())
    proposer.prepare(state)
    tree = proposer.propose(state, Budget(4, 4))
    assert tree.num_nodes == 4
    chain = [int(t) for t in tree.tokens]
    state.tokens += [chain[0], 42]  # one accepted, the bonus 42
    feedback = VerifyFeedback.of([3, *chain], np.array([[chain[0]], [42], [7], [8], [9]]))
    proposer.observe(state, DraftFeedback(committed_len=5, verified=(feedback,)))
    session = state.scratch["jacobi"]
    assert min(session.guesses) >= 5  # positions 3, 4 are committed: their guesses are gone
    assert [int(t) for t in proposer.propose(state, Budget(3, 3)).tokens] == [7, 8, 9]
