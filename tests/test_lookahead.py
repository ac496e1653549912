"""The `lookahead` proposer: lookahead decoding's n-gram pool and verification branch (issue 14, item 2).

The 2-D window itself (verifier side) is tested in test_verifier_feedback.py; the registry-wide tests
(test_greedy_equivalence, test_overlap, test_batched_verifier, test_sampling_distribution) run this
proposer with the window it asks for. Here:

- the pool keeps at most G continuations per key, least recently seen dropped first, and the tree is
  their prefix-sharing merge within the budget;
- the pool learns harvested n-grams, the prompt's and the committed output's (never a hypothesis);
- the embedded stack runs the window the proposer asks for, unless --lookahead says otherwise;
- on a target whose text loops the window's n-grams alone make it speculate well, and the output is
  still the target's greedy output; over gRPC too, with the verifier's --lookahead window.
"""

from __future__ import annotations

import pytest
from spec_helpers import RecordingVerifier, engine_for, greedy, make_prompts, window_for

from drafter_service.lookahead import LookaheadProposer, NGramPool, lookahead_proposer, pool_tree
from drafter_service.proposer import DraftSessionState, make_proposer, proposer_spec
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback, VerifyFeedback
from specmesh.sampling import SamplingParams
from verifier_service.lookahead import LookaheadConfig

PROMPTS = make_prompts(6, seed=23)
MAX_NEW = 40


# ------------------------------------------------------------------------- pool
def test_pool_keeps_the_most_recent_g_continuations_per_key():
    pool = NGramPool(guesses=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # seen again: most recent now
    assert pool.continuations(1) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over G: the least recently seen (4, 5) goes
    assert pool.continuations(1) == [(6, 7), (2, 3)]
    assert pool.continuations(9) == []
    pool.add([5])  # too short to continue anything
    assert pool.continuations(5) == []


def test_pool_learns_text_ngrams_from_a_start():
    pool = NGramPool(guesses=8)
    pool.add_text([1, 2, 3, 1, 2, 4], 3, start=1)  # n-grams starting at 1..3
    assert pool.continuations(2) == [(3, 1)]
    assert pool.continuations(3) == [(1, 2)]
    assert pool.continuations(1) == [(2, 4)]


def test_tree_merges_shared_prefixes_within_the_budget():
    conts = [(5, 6, 7), (5, 6, 8), (9, 1, 2)]
    tree = pool_tree(conts, Budget(10, 3), "lookahead")
    assert tree.num_nodes == 7 and tree.max_depth == 3
    assert sorted(tuple(tree.tokens[p].tolist()) for p in tree.paths()) == sorted(conts)
    small = pool_tree(conts, Budget(4, 2), "lookahead")
    assert small.num_nodes <= 4 and small.max_depth <= 2
    assert small.tokens.tolist()[:2] == [5, 6]  # best first
    assert pool_tree([], Budget(4, 2), "x").num_nodes == 0


# ---------------------------------------------------------------------- proposer
def _state(tokens) -> DraftSessionState:
    return DraftSessionState("s", list(tokens), SamplingParams())


def test_proposer_learns_harvests_prompt_and_committed_output_only():
    prop = LookaheadProposer(window=3, ngram=3, guesses=4)
    state = _state([7, 8, 9, 7, 8])
    prop.prepare(state)
    assert prop.propose(state, Budget(8, 2)).tokens.tolist() == [9, 7]  # the prompt's 3-gram (8, 9, 7)
    state.tokens += [9]
    tree = prop.propose(state, Budget(8, 2))
    assert tree.tokens.tolist() == [7, 8]  # the prompt's 3-gram (9, 7, 8)
    # a harvested n-gram, then a hypothesis (drafted ahead, not committed) that must not be learned
    state.tokens += [1, 2, 3]
    state.committed_len = len(state.tokens) - 2  # what LocalDrafter records from the feedback
    prop.observe(state, DraftFeedback(committed_len=state.committed_len,
                                      verified=(VerifyFeedback.of([3], None, [(3, 4, 5)]),)))
    assert prop.propose(state, Budget(8, 2)).tokens.tolist() == [4, 5]
    assert _continuations(prop, state, 8) == [(9, 1), (9, 7)]  # the committed output's n-gram, newest first
    assert _continuations(prop, state, 9) == [(7, 8)]  # (9, 1, 2) reaches into the hypothesis: not learned
    assert _continuations(prop, state, 1) == []
    prop.release(state)
    assert prop.name not in state.scratch


def _continuations(prop, state, key):
    return state.scratch[prop.name].pool.continuations(key)


def test_options_and_registry():
    prop = make_proposer("lookahead", window=6, ngram=3, guesses=8, from_prompt=0)
    assert (prop.window, prop.ngram, prop.guesses, prop.from_prompt) == (6, 3, 8, False)
    assert prop.feedback_window == (6, 3) and prop.feedback_min_ngram == 2
    assert proposer_spec("lookahead").default_budget == (12, 3)
    default = lookahead_proposer()
    assert window_for(default) == LookaheadConfig(2, 4)
    ablation = make_proposer("lookahead", window=0)  # no verifier window: prompt and output n-grams only
    assert ablation.feedback_window is None and ablation.feedback_min_ngram == 0
    for bad in (dict(window=-1), dict(ngram=1), dict(guesses=0), dict(depth=3)):
        with pytest.raises(ValueError):
            make_proposer("lookahead", **bad)


# ------------------------------------------------------------------ end to end
def _occurs(seq: list[int], text: list[int]) -> bool:
    n = len(seq)
    return any(text[i : i + n] == seq for i in range(len(text) - n + 1))


def test_window_ngrams_reach_past_the_committed_text(model_sets, ar_reference):
    """No prompt n-grams: the pool learns from the window's harvests and the committed output. Output == AR
    either way. Without the window every accepted continuation already occurred in the committed text (the
    pool knows nothing else); with it, some accepted continuations had never occurred: they came from the
    target's own Jacobi iterations."""
    ms = model_sets("cyclic")
    runner = ms.runner("target", "fast")
    novel, accepted = {}, {}
    for label, window in (("window", True), ("none", False)):
        prop = make_proposer("lookahead", from_prompt=0)
        verifier = RecordingVerifier(runner, lookahead=window_for(prop) if window else None)
        engine = engine_for(runner, prop, 12, 3, verifier=verifier)
        novel[label] = accepted[label] = 0
        for prompt in PROMPTS:
            verifier.log.clear()
            res = engine.generate(prompt, greedy(MAX_NEW))
            assert res.token_ids == ar_reference("cyclic", "fast", prompt, MAX_NEW)
            committed = list(prompt) + res.token_ids[:1]
            for _, result in verifier.log:
                if result.num_accepted:
                    accepted[label] += 1
                    novel[label] += not _occurs([committed[-1], *result.tokens[:-1]], committed)
                committed += result.tokens
    assert novel["none"] == 0 and accepted["none"] > 0, (novel, accepted)
    assert novel["window"] >= 3, (novel, accepted)


def test_stack_runs_the_window_the_proposer_asks_for(demo_stack):
    engine = demo_stack.engine("lookahead", window=3, ngram=3)
    assert engine.method.lookahead == LookaheadConfig(3, 3)  # the window rows of its requests on the core
    assert demo_stack.engine("lookahead", window=0).method.lookahead is None
    prompt = demo_stack.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    plain = demo_stack.engine(None).generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
    for overlap in (False, True):
        out = demo_stack.engine("lookahead", overlap=overlap).generate(prompt, SamplingParams(max_new_tokens=40))
        assert out.token_ids == plain
    assert demo_stack.engine("prompt_lookup").method.lookahead is None  # no n-gram learner: no window rows


def test_the_core_takes_the_stacks_window_however_wide(demo_stack):
    """The embedded stack's one engine core takes any request's window up to MAX_WINDOW_ROWS, and the stack's own
    `--lookahead` window when it is wider (40 rows here): the core's verifier and the context the stack says it
    serves leave room for the same window, and a request with it gives plain decoding's tokens."""
    import dataclasses
    import threading

    from orchestrator.embedded import MAX_WINDOW_ROWS

    wide = LookaheadConfig(8, 6)
    assert wide.rows > MAX_WINDOW_ROWS
    stack = dataclasses.replace(demo_stack, lookahead=wide, _core=None, _engines={}, _shared_lock=threading.Lock())
    try:
        prompt = stack.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
        engine = stack.engine("retrieval", fresh=True)
        assert engine.method.lookahead == wide
        out = engine.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert out == demo_stack.engine(None).generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert stack.core.scheduler.verifier.max_window_rows == stack.max_window_rows == wide.rows
        assert stack.served_info().max_positions == stack.core.info.max_positions
    finally:
        stack.close()


def test_over_grpc_with_the_verifiers_window_equals_ar(demo_stack):
    import service_helpers as sh

    from specmesh.client import Client

    services = []
    try:
        v, d = sh.verifier("--lookahead", "4,4"), sh.drafter()
        services += [v, d]
        sh.start_all(v, d)
        s = sh.serve([v], [d])
        services.append(s)
        s.wait_ready()
        with Client(s.address, timeout=120) as client:
            for text in ("def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n"):
                prompt = demo_stack.tokenizer.encode(text)
                plain = demo_stack.engine(None).generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
                for overlap in (False, True):
                    remote = client.generate(text, max_new_tokens=40, proposer="lookahead", overlap=overlap)
                    assert remote.token_ids == plain, (text, overlap)
                    assert remote.stats["draft_errors"] == 0
    finally:
        for svc in services:
            svc.stop()

