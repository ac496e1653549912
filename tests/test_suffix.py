"""Suffix decoding: the counted suffix trie against brute force, and the proposer over it.

The index (drafter_service/suffix_index.py) must count every string of up to its depth exactly as often as it
occurs in the sequences it holds, while sequences grow a few tokens at a time and the oldest are forgotten; a
speculation's first level must be the next-token distribution after the longest suffix of the context that occurs
with a continuation. Greedy output equal to plain decoding is checked with every other proposer
(tests/test_greedy_equivalence.py, tests/test_overlap.py sweep the registry).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_helpers import RedisServer
from service_helpers import wait_until
from spec_helpers import engine_for, greedy, make_prompts

from drafter_service.ngram_store import open_store
from drafter_service.proposer import DraftSessionState, make_proposer
from drafter_service.suffix import SuffixProposer
from drafter_service.suffix_index import SuffixIndex
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams


def occurrences(seqs, pattern) -> int:
    k = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - k + 1) if s[i : i + k] == pattern)


def next_tokens(seqs, pattern) -> Counter:
    k = len(pattern)
    return Counter(s[i + k] for s in seqs for i in range(len(s) - k) if s[i : i + k] == pattern)


sequences = st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5)


@settings(max_examples=60)
@given(seqs=sequences, depth=st.sampled_from([1, 2, 3, 5]), chunk=st.integers(1, 7),
       max_tokens=st.sampled_from([None, 12, 40]))
def test_counts_equal_brute_force_while_growing_and_forgetting(seqs, depth, chunk, max_tokens):
    index = SuffixIndex(depth, max_tokens, initial_tokens=4)  # tiny: the tables grow many times
    held: list[list[int]] = []
    for seq in seqs:
        for lo in range(0, len(seq), chunk):
            index.extend(seq[lo : lo + chunk])
            live = [*held, seq[: lo + chunk]]
            for s in live:  # every string the index holds, and one it does not
                for a in range(len(s)):
                    for k in range(1, min(depth, len(s) - a) + 1):
                        assert index.count(s[a : a + k]) == occurrences(live, s[a : a + k])
            assert index.count([4] * depth) == 0
        index.close()
        held.append(seq)
        while max_tokens is not None and held and sum(map(len, held)) > max_tokens:
            held.pop(0)  # the oldest first
        assert index.num_tokens == sum(map(len, held))
        for s in held:
            for a in range(len(s)):
                for k in range(1, min(depth, len(s) - a) + 1):
                    assert index.count(s[a : a + k]) == occurrences(held, s[a : a + k])


@settings(max_examples=80)
@given(seqs=sequences, depth=st.sampled_from([2, 3, 4, 8]), tail=st.lists(st.integers(0, 3), max_size=4),
       pick=st.integers(0, 4), cut=st.integers(1, 6))
def test_first_level_is_the_next_token_distribution_of_the_longest_match(seqs, depth, tail, pick, cut):
    index = SuffixIndex(depth)
    for s in seqs[:-1]:
        index.add(s)
    index.extend(seqs[-1])  # the last one still open, as a request's own context is
    context = tail + seqs[pick % len(seqs)][-cut:]
    pattern = context[-(depth - 1) :]
    match = next((k for k in range(len(pattern), 0, -1) if next_tokens(seqs, pattern[-k:])), 0)
    if not match:
        assert index.speculate(context, 64, 1, spec_factor=100.0).tokens.size == 0
        return
    # one level, every child, grown from the longest match only (min_match: no shorter one is tried)
    spec = index.speculate(context, 64, 1, spec_factor=100.0, min_match=match)
    assert spec.match_len == match
    counts = next_tokens(seqs, pattern[-match:])
    # each child's share of the match's occurrences, the newest not counted when nothing follows it
    ends = [(j, i + match) for j, s in enumerate(seqs) for i in range(len(s) - match + 1)
            if s[i : i + match] == pattern[-match:]]
    newest_seq, newest_end = ends[-1]
    total = len(ends) - (newest_end == len(seqs[newest_seq]))
    assert dict(zip(spec.tokens.tolist(), spec.probs.tolist(), strict=True)) == pytest.approx(
        {t: c / total for t, c in counts.items()})
    assert (spec.parents == -1).all()


def test_the_tree_is_best_first_within_its_limits():
    index = SuffixIndex(8)
    for _ in range(3):
        index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 9, 9, 9])
    spec = index.speculate([7, 1, 2], 16, 16, spec_factor=100.0)
    assert spec.match_len == 2
    # after "1 2": 3 always; then 4 (3 of 4) or 9 (1 of 4); each line goes on with probability 1, likelier first
    assert spec.tokens.tolist() == [3, 4, 5, 6, 9, 9, 9] and spec.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5]
    assert spec.probs.tolist() == pytest.approx([1.0, 0.75, 1, 1, 0.25, 1, 1])
    assert spec.score == pytest.approx(1 + 3 * 0.75 + 3 * 0.25)  # expected accepted tokens: the path probabilities
    # nodes: the match length times the factor; a path below min_prob is not grown
    assert index.speculate([1, 2], 16, 16, spec_factor=1.5).tokens.size == 3
    assert 9 not in index.speculate([1, 2], 16, 16, spec_factor=100.0, min_prob=0.3).tokens.tolist()
    assert index.speculate([1, 2], 16, 2, spec_factor=100.0).tokens.tolist() == [3, 4, 9]  # depth 2
    # past the trie's depth a line follows its newest occurrence
    deep = SuffixIndex(3)
    deep.add(list(range(20)))
    assert deep.speculate([0, 1], 30, 30, spec_factor=100.0).tokens.tolist() == list(range(2, 20))


def test_token_ids_out_of_range_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        SuffixIndex(4).extend([-1])
    with pytest.raises(ValueError, match="depth"):
        SuffixIndex(0)


def _state(tokens, committed=0):
    state = DraftSessionState("s", list(tokens), SamplingParams(max_new_tokens=8))
    state.committed_len = committed
    return state


def test_the_proposer_indexes_committed_tokens_only_and_learns_outputs_at_close():
    proposer = make_proposer("suffix")
    assert isinstance(proposer, SuffixProposer)
    prompt = [5, 6, 7, 8, 9] * 4
    state = _state(prompt)
    proposer.prepare(state)
    tree = proposer.propose(state, Budget(8, 8))
    assert tree.tokens.tolist()[:4] == [5, 6, 7, 8] and set(tree.sources) == {"suffix"}
    # a hypothesis after the committed tokens is matched but not indexed
    state.tokens += [100, 101, 102]
    state.committed_len = len(prompt)
    proposer.propose(state, Budget(8, 8))
    assert state.scratch["suffix"].index.count([100]) == 0
    # the session's output goes to the global index at close: another session continues it
    state.tokens[len(prompt) :] = [40, 41, 42, 43, 44, 45]
    state.committed_len = len(state.tokens)
    proposer.release(state)
    assert proposer.global_index.count([40, 41, 42]) == 1 and proposer.global_index.count([5, 6]) == 0
    other = _state([1, 2, 40, 41])
    proposer.prepare(other)
    assert proposer.propose(other, Budget(8, 8)).tokens.tolist()[:2] == [42, 43]


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="no option"):
        make_proposer("suffix", depth=3)
    with pytest.raises(ValueError, match="learn"):
        make_proposer("suffix", learn="everything")
    assert make_proposer("suffix", learn="none").global_index is None
    assert make_proposer("suffix", global_tokens=0).global_index is None


def test_speculation_with_a_real_target_is_accepted(model_sets, ar_reference):
    """A looping target: the output repeats, the suffix tries see it, trees are accepted; greedy == AR."""
    target = model_sets("cyclic").runner("target", "fast")
    engine = engine_for(target, "suffix", 16, 8)
    accepted = 0
    for prompt in make_prompts(4, seed=3):
        result = engine.generate(prompt, greedy(32))
        assert result.token_ids == ar_reference("cyclic", "fast", prompt, 32)
        accepted += sum(s.num_accepted for s in result.stats.steps)
    assert accepted > 0


def _serve_one(proposer, prompt, output) -> None:
    """A session on ``proposer`` that commits ``output`` after ``prompt`` and closes."""
    state = _state(prompt)
    proposer.prepare(state)
    state.tokens += output
    state.committed_len = len(state.tokens)
    proposer.release(state)


def test_replicas_share_their_outputs_through_the_fleet_log_and_survive_its_loss():
    """Two replicas' proposers on one Redis: what A wrote, B drafts from within a second (and not A's own twice); a
    third started later replays the log; with Redis gone each keeps serving from its own index. B is built as a
    drafter replica builds it (from the ``--ngram-store`` it opened), A as the embedded stack does (from the spec):
    a replica once had no fleet log at all (its resources name ``store``, which the factory ignored)."""
    server = RedisServer()
    replicas = []
    try:
        a = make_proposer("suffix", store_spec=server.url, store_namespace="tok-1")  # embedded: the store's spec
        b = make_proposer("suffix", store=open_store(server.url, "tok-1"))  # a drafter replica: its opened store
        other_model = make_proposer("suffix", store_spec=server.url, store_namespace="tok-2")
        replicas += [a, b, other_model]
        output = [40, 41, 42, 43, 44, 45, 46, 47]
        _serve_one(a, [1, 2, 3], output)
        assert wait_until(lambda: b.global_index.count(output) == 1)
        assert wait_until(lambda: a.fleet_log.published == 1) and a.global_index.count(output) == 1  # not twice
        other = _state([9, 40, 41, 42])
        b.prepare(other)
        assert b.propose(other, Budget(8, 8)).tokens.tolist()[:3] == [43, 44, 45]
        late = make_proposer("suffix", store_spec=server.url, store_namespace="tok-1")
        replicas.append(late)
        assert wait_until(lambda: late.global_index.count(output) == 1)  # replayed at start
        assert other_model.global_index.count([40, 41]) == 0  # another tokenizer's stream
        server.stop()
        _serve_one(a, [1], [70, 71, 72, 73])  # published nowhere: dropped, counted, still local
        assert wait_until(lambda: a.fleet_log.dropped == 1) and a.global_index.count([70, 71, 72]) == 1
        b.prepare(other)
        assert b.propose(other, Budget(8, 8)).tokens.tolist()[:3] == [43, 44, 45]  # B serves from its own index
        assert wait_until(lambda: b.fleet_log.failures > 0)  # its follower noticed, and retries with backoff
    finally:
        for proposer in replicas:
            proposer.fleet_log.close()
        server.stop()


def test_the_replay_benchmark_takes_method_specs():
    """benchmarks/draft_cost.py replays recorded outputs through a proposer given as a bench method spec."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import draft_cost

    prompt = list(range(10, 60))
    output = prompt[20:45] + [7, 8, 9] + prompt[30:50]  # a copy, an edit, a copy
    wide = draft_cost.replay("suffix:max_spec_factor=4,max_nodes=8,max_depth=8", [prompt], [output])
    assert wide["budget"] == [8, 8] and wide["tau"] > 3
    narrow = draft_cost.replay("suffix:max_nodes=2,max_depth=2", [prompt], [output])
    assert narrow["tau"] < wide["tau"] and narrow["nodes_per_tree"] <= 2
    with pytest.raises(ValueError, match="engine"):
        draft_cost.replay("suffix:overlap=1", [prompt], [output])


def test_a_built_proposer_has_compiled_everything_a_request_runs():
    """``warm_up`` (run when a suffix proposer is built) leaves nothing for numba to compile on a request's path:
    in a fresh process, a proposer's whole life (prepare, proposals as tokens commit, release into a bounded global
    index that forgets) adds no signature to any compiled function, and every function the host calls has been
    compiled (a helper only compiled code calls is compiled into its callers)."""
    import subprocess
    import sys

    code = """
import numpy as np
from numba.core.registry import CPUDispatcher
import drafter_service.suffix_index as m
from drafter_service.ngram_store import open_store
from drafter_service.proposer import DraftSessionState, make_proposer
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams

proposer = make_proposer("suffix", global_tokens=64)
compiled = {n: f for n, f in vars(m).items() if isinstance(f, CPUDispatcher) and f.targetoptions.get("inline") != "always"}
before = {n: len(f.signatures) for n, f in compiled.items()}
rng = np.random.default_rng(0)
for _ in range(6):
    tokens = rng.integers(0, 5, 40).tolist()
    state = DraftSessionState("s", tokens[:10], SamplingParams(max_new_tokens=30))
    for n in range(10, 40, 3):
        state.tokens[:] = tokens[:n]
        state.committed_len = n
        proposer.propose(state, Budget(8, 4))
    proposer.release(state)
after = {n: len(f.signatures) for n, f in compiled.items()}
entries = ("_propose", "_extend", "_close", "_evict", "_speculate", "_count", "_rehash")  # called from Python
print(sorted(n for n in entries if not before[n]), sorted(n for n in compiled if after[n] != before[n]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["[]", "[]"], out.stdout + out.stderr
