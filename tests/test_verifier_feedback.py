"""Verification feedback: top-k rows and the Jacobi window's n-grams (issue 4, verifier side).

- top-k rows are the target's top-k after each verified row, as a full recompute computes them;
- the window rides along without changing anything: greedy output equals AR, the KV cache
  equals a fresh prefill, seeded sampling is unchanged;
- the harvested n-grams are the diagonals of the Jacobi trajectory (pure functions, against
  an explicit 2-D trajectory), and on a target whose text loops they predict the output;
- feedback crosses the wire: a real verifier process answers what the in-process one does.
"""

from __future__ import annotations

import argparse
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from spec_helpers import (
    BACKENDS,
    VOCAB,
    RecordingVerifier,
    assert_cache_matches,
    engine_for,
    fresh_kv,
    greedy,
    make_prompts,
)

from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree, ancestor_mask
from verifier_service.lookahead import (
    NO_TOKEN,
    LookaheadConfig,
    branch_parents,
    fill,
    harvest,
    initial_trail,
    note_successors,
    shift_trail,
    window_span,
)
from verifier_service.verifier import LocalVerifier

PROMPTS = make_prompts(8, seed=5)
MAX_NEW = 32
WINDOWS = [LookaheadConfig(1, 2), LookaheadConfig(4, 3), LookaheadConfig(7, 4)]


def _cfg_id(cfg: LookaheadConfig | None) -> str:
    return "off" if cfg is None else f"W{cfg.window}N{cfg.ngram}"


# ===================================================================== pure functions
def test_lookahead_config_validates_and_parses():
    assert LookaheadConfig.parse("4,3") == LookaheadConfig(4, 3)
    for bad in ["4", "4,3,2", "a,3", "0,3", "4,1", ""]:
        with pytest.raises(ValueError):
            LookaheadConfig.parse(bad)
    with pytest.raises(ValueError):
        LookaheadConfig(2.5, 3)


def test_window_is_a_chain_off_the_pending_token_beside_the_tree():
    tree_parents = np.array([-1, -1, 0, 2], np.int64)  # nodes 0, 1 under pending; 2 under 0; 3 under 2
    anc = ancestor_mask(branch_parents(tree_parents, 3))  # rows: pending, 4 nodes, 3 window tokens
    assert anc.shape == (8, 8)
    tree_rows, window_rows = range(1, 5), range(5, 8)
    for r in window_rows:  # pending + the window tokens up to itself, no tree node
        assert anc[r].nonzero()[0].tolist() == [0, *range(5, r + 1)]
    for r in tree_rows:  # the tree never sees the window
        assert not anc[r, 5:].any() and anc[r, 0]
    np.testing.assert_array_equal(anc[:5, :5], ancestor_mask([-1, *(tree_parents + 1).tolist()]))
    assert branch_parents(tree_parents, 0) == [-1, 0, 0, 1, 3]
    assert branch_parents(np.zeros(0, np.int64), 2) == [-1, 0, 1]


def test_window_span_shrinks_at_the_context_end():
    assert window_span(10, 4, 100) == 4
    assert window_span(96, 4, 100) == 3  # positions 97, 98, 99
    assert window_span(99, 4, 100) == 0


def test_shift_keeps_the_guesses_still_ahead_and_fills_the_rest():
    successors = {5: 6, 6: 7}
    trail = np.array([[10, 11, 12, 13], [20, 21, 22, 23]])  # N = 3, W = 4; row -1 fed at P+1..P+4
    outputs = np.array([30, 31, 32, 33])  # guesses for P+2..P+5
    # nothing accepted, bonus at P+1: plain Jacobi, every position keeps a guess
    np.testing.assert_array_equal(shift_trail(trail, outputs, 1, 99, successors),
                                  [[20, 21, 22, 23], [30, 31, 32, 33]])
    # two accepted + bonus (at P+3): guesses for P+4, P+5 stay; P+6, P+7 are fills after 33 (no successor)
    np.testing.assert_array_equal(shift_trail(trail, outputs, 3, 5, successors),
                                  [[22, 23, NO_TOKEN, NO_TOKEN], [32, 33, 33, 33]])
    # more committed than the window covers: all fills, a bigram chain from the bonus
    np.testing.assert_array_equal(shift_trail(trail, outputs, 6, 5, successors),
                                  [[NO_TOKEN] * 4, [6, 7, 7, 7]])
    # a cropped window (span 2 < W): the rest are fills
    np.testing.assert_array_equal(shift_trail(trail, outputs[:2], 1, 99, successors),
                                  [[20, 21, NO_TOKEN, NO_TOKEN], [30, 31, 31, 31]])


def test_fills_and_initial_window_follow_the_most_recent_successor():
    successors: dict[int, int] = {}
    note_successors(successors, [1, 2, 3, 1, 4])
    assert successors == {1: 4, 2: 3, 3: 1}
    assert fill(3, 5, successors) == [1, 4, 4, 4, 4]
    np.testing.assert_array_equal(initial_trail(2, LookaheadConfig(3, 3), successors),
                                  [[NO_TOKEN] * 3, [3, 1, 4]])


def test_harvest_takes_full_diagonals_once():
    trail = np.array([[1, NO_TOKEN, 1, 1], [2, 5, 2, 2]])
    assert harvest(trail, np.array([3, 6, 3, 4])) == [(1, 2, 3), (1, 2, 4)]
    assert harvest(np.zeros((2, 0), np.int64), np.zeros(0, np.int64)) == []


def _fake_target(seq: tuple[int, ...], vocab: int) -> int:
    """A deterministic 'target': the next token depends on the last two tokens (and a little on length)."""
    return zlib.crc32(repr((seq[-2:], len(seq) % 3)).encode()) % vocab


@given(
    window=st.integers(1, 6),
    ngram=st.integers(2, 5),
    vocab=st.integers(3, 12),
    seed=st.integers(0, 2**31),
    context_end=st.integers(12, 60),
)
def test_harvested_ngrams_are_the_diagonals_of_the_jacobi_trajectory(window, ngram, vocab, seed, context_end):
    """Simulate the verifier's window state with the pure functions and keep the whole 2-D trajectory
    (fed window and outputs per iteration, keyed by absolute position) beside it: every step's harvest
    is exactly the diagonals of N - 1 fed tokens + one output that the trajectory holds, where each
    link was predicted right after its diagonal predecessor."""
    rng = random.Random(seed)
    cfg = LookaheadConfig(window, ngram)
    context = [rng.randrange(vocab) for _ in range(rng.randint(2, 8))]  # committed, pending last
    successors: dict[int, int] = {}
    note_successors(successors, context)
    trail = initial_trail(context[-1], cfg, successors)
    fed: list[dict[int, int]] = []  # iteration -> {position: token fed}
    kept: list[set[int]] = []  # iteration -> positions whose fed token is the previous iteration's output there
    outs: list[dict[int, int]] = []  # iteration -> {position: the target's argmax}
    links: set[tuple[int, int]] = set()  # (last input token, output) of every prediction made
    while len(context) < context_end:
        prefix_len = len(context) - 1  # the pending token sits at prefix_len
        span = window_span(prefix_len, window, context_end + 2)
        guesses = trail[-1, :span].tolist()
        fed.append({prefix_len + 1 + j: g for j, g in enumerate(guesses)})
        prev = outs[-1] if outs else {}
        kept.append({p for p in fed[-1] if p in prev})  # the shift keeps those guesses (checked below)
        outputs = []
        for j in range(span):  # window token j sees the context and window tokens 0..j
            outputs.append(_fake_target(tuple(context + guesses[: j + 1]), vocab))
            links.add((guesses[j], outputs[-1]))
        outs.append({prefix_len + 2 + j: o for j, o in enumerate(outputs)})
        got = harvest(trail[:, :span], np.asarray(outputs, np.int64))

        t = len(fed) - 1
        want: list[tuple[int, ...]] = []
        for q in sorted(outs[t]):
            gram, ok = [outs[t][q]], True
            for d in range(ngram - 1):  # back along the diagonal: position q-1-d in iteration t-d
                pos, it = q - 1 - d, t - d
                if it < 0 or pos not in fed[it] or (d < ngram - 2 and pos not in kept[it]):
                    ok = False
                    break
                gram.insert(0, fed[it][pos])
            if ok and tuple(gram) not in want:
                want.append(tuple(gram))
        assert got == want
        for gram in got:  # Jacobi's property: each token was predicted right after its predecessor
            assert all((a, b) in links for a, b in zip(gram, gram[1:], strict=False))

        committed = [rng.randrange(vocab) for _ in range(rng.randint(1, window + 2))]  # accepted + bonus
        note_successors(successors, [context[-1], *committed])
        trail = shift_trail(trail, np.asarray(outputs, np.int64), len(committed), committed[-1], successors)
        # the guesses still ahead survive the shift
        new_start = prefix_len + len(committed) + 1
        for i, g in enumerate(trail[-1].tolist()):
            if new_start + i in outs[t]:
                assert g == outs[t][new_start + i]
        context += committed


# ========================================================================= top-k rows
def _random_tree(rng: random.Random, max_nodes: int) -> TokenTree:
    n = rng.randint(0, max_nodes)
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    return TokenTree(np.asarray([rng.randrange(VOCAB) for _ in range(n)], np.int64), np.asarray(parents, np.int64),
                     np.ones(n))


@torch.no_grad()
def _naive_topk(model, seq: list[int], k: int) -> list[int]:
    return torch.topk(model(torch.tensor([seq])).logits[0, -1], k).indices.tolist()


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(4, 3)], ids=_cfg_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_rows_equal_a_full_recompute(model_sets, backend, lookahead):
    """Random trees (chains, bushy trees, empty), several steps per session: row r's top-k is the
    target's top-k after the committed tokens + the path to r, recomputed without any cache."""
    ms = model_sets("random")
    k = 5
    verifier = LocalVerifier(ms.runner("target", backend), feedback_topk=k, lookahead=lookahead)
    rng = random.Random(7)
    rows = 0
    for s, prompt in enumerate(PROMPTS[:3]):
        committed = list(prompt) + [verifier.prefill(f"s{s}", prompt, greedy(MAX_NEW)).first_token]
        for _ in range(5):
            tree = _random_tree(rng, 10)
            result = verifier.verify(f"s{s}", tree)
            fb = result.feedback
            assert fb.inputs.tolist() == [committed[-1], *tree.tokens.tolist()]
            assert fb.topk.shape == (tree.num_nodes + 1, k) and fb.topk.dtype == np.int64
            assert fb.topk[0].tolist() == _naive_topk(ms.target, committed, k)
            for i in range(tree.num_nodes):
                path = tree.tokens[tree.path_to(i)].tolist()
                assert fb.topk[i + 1].tolist() == _naive_topk(ms.target, committed + path, k), (s, i)
            # greedy: the bonus is the top-1 of the last accepted row
            last = result.accepted_nodes[-1] + 1 if result.accepted_nodes else 0
            assert result.tokens[-1] == fb.topk[last, 0]
            if lookahead is None:
                assert fb.ngrams == ()
            committed += result.tokens
            rows += tree.num_nodes + 1
        verifier.release(f"s{s}")
    assert rows > 30


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_rows_are_jacobi_iterations(model_sets, backend):
    """Beside random trees, the argmax after window token j is the target's argmax after the committed
    tokens + window tokens 0..j (positions and mask right, no tree node seen); the shifted window holds
    those outputs for the positions still ahead."""
    ms = model_sets("cyclic")
    cfg = LookaheadConfig(5, 3)
    verifier = LocalVerifier(ms.runner("target", backend), lookahead=cfg)
    rng = random.Random(11)
    checked = 0
    for s, prompt in enumerate(PROMPTS[:3]):
        committed = list(prompt) + [verifier.prefill(f"s{s}", prompt, greedy(MAX_NEW)).first_token]
        for _ in range(6):
            guesses = verifier._sessions[f"s{s}"].trail[-1].tolist()
            naive = [_naive_topk(ms.target, committed + guesses[: j + 1], 1)[0] for j in range(cfg.window)]
            result = verifier.verify(f"s{s}", _random_tree(rng, 8))
            a = result.num_accepted
            new = verifier._sessions[f"s{s}"].trail[-1].tolist()
            assert new[: cfg.window - a] == naive[a:], (s, a)
            checked += cfg.window - a
            committed += result.tokens
    assert checked > 40


def test_feedback_is_off_by_default_and_lookahead_alone_has_no_topk(model_sets):
    runner = model_sets("random").runner("target", "fast")
    prompt = PROMPTS[0]
    plain = LocalVerifier(runner)
    plain.prefill("a", prompt, greedy(8))
    assert plain.verify("a", TokenTree.chain([3, 4])).feedback is None
    window = LocalVerifier(runner, lookahead=LookaheadConfig(3, 2))
    window.prefill("a", prompt, greedy(8))
    fb = window.verify("a", TokenTree.chain([3, 4])).feedback
    assert fb.k == 0 and fb.inputs.shape == (3,) and len(fb.ngrams) > 0  # the initial window has full diagonals
    assert all(len(g) == 2 for g in fb.ngrams)
    with pytest.raises(ValueError):
        LocalVerifier(runner, feedback_topk=-1)


# ========================================================== the window changes nothing
def _stream_checking_cache(engine, verifier, prompt, sampling) -> list[int]:
    """Stream one request; after each step the verifier cache equals a fresh prefill of the committed tokens."""
    committed = list(prompt)
    out: list[int] = []
    for event in engine.stream(prompt, sampling):
        (session,) = verifier._sessions.values()
        committed += event.tokens
        out += event.tokens
        assert committed[-1] == session.pending
        assert_cache_matches(session.cache, fresh_kv(verifier.runner, committed[:-1]), "verifier cache")
    return out


@pytest.mark.parametrize("lookahead", WINDOWS, ids=_cfg_id)
@pytest.mark.parametrize("proposer", ["prompt_lookup", "prompt_lookup_tree", "draft_model_tree"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_with_window_equals_ar_and_cache_is_exact(model_sets, ar_reference, backend, proposer, lookahead):
    kind = "random" if proposer.startswith("draft_model") else "cyclic"
    ms = model_sets(kind)
    runner = ms.runner("target", backend)
    verifier = RecordingVerifier(runner, feedback_topk=2, lookahead=lookahead)
    engine = engine_for(runner, proposer, 12, 5, draft_runner=ms.runner("near", backend), verifier=verifier)
    accepted = harvested = 0
    for prompt in PROMPTS[:4]:
        verifier.log.clear()
        out = _stream_checking_cache(engine, verifier, prompt, greedy(MAX_NEW))
        assert out == ar_reference(kind, backend, prompt, MAX_NEW)
        accepted += sum(r.num_accepted for _, r in verifier.log)
        harvested += sum(len(r.feedback.ngrams) for _, r in verifier.log)
        assert all(len(g) == lookahead.ngram for _, r in verifier.log for g in r.feedback.ngrams)
    assert accepted > 0 and harvested > 0  # not vacuous: trees were accepted beside the window


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_shrinks_at_the_end_of_the_context(model_sets, backend):
    """A request that runs up to the last position: the window is cropped, never an error."""
    ms = model_sets("cyclic")
    runner = ms.runner("target", backend)
    max_pos = runner.info.max_positions
    prompt = (PROMPTS[1] * (max_pos // len(PROMPTS[1]) + 1))[: max_pos - 12]
    verifier = RecordingVerifier(runner, lookahead=LookaheadConfig(7, 3))
    engine = engine_for(runner, "prompt_lookup_tree", 12, 5, verifier=verifier)
    out = _stream_checking_cache(engine, verifier, prompt, greedy(12))
    assert out == engine_for(runner).generate(prompt, greedy(12)).token_ids
    assert len(prompt) + len(out) == max_pos


@pytest.mark.parametrize("proposer", ["prompt_lookup_tree", "draft_model"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_is_unchanged_by_the_window(model_sets, backend, proposer):
    """The window uses no randomness and the verified rows do not see it: same seed, same tokens."""
    ms = model_sets("cyclic")
    runner, draft = ms.runner("target", backend), ms.runner("near", backend)
    outs = {}
    for cfg in [None, LookaheadConfig(4, 3)]:
        verifier = LocalVerifier(runner, feedback_topk=3, lookahead=cfg)
        engine = engine_for(runner, proposer, 12, 5, draft_runner=draft, verifier=verifier)
        outs[cfg] = [
            engine.generate(p, SamplingParams(temperature=1.0, top_k=20, seed=i, max_new_tokens=MAX_NEW,
                                              ignore_eos=True)).token_ids
            for i, p in enumerate(PROMPTS[:4])
        ]
    baseline = outs[None]
    assert outs[LookaheadConfig(4, 3)] == baseline
    assert len({tuple(o) for o in baseline}) == len(baseline)


# =================================================================== the feature works
def test_window_ngrams_predict_a_looping_target(model_sets, ar_reference):
    """On a target whose greedy text loops, the harvested n-grams are mostly real continuations: many
    occur in the AR output, and many occur in the part of the output not committed when harvested."""
    ms = model_sets("cyclic")
    runner = ms.runner("target", "fast")
    cfg = LookaheadConfig(4, 3)
    verifier = RecordingVerifier(runner, lookahead=cfg)
    engine = engine_for(runner, verifier=verifier)  # plain decoding: the window is the only speculation
    total = in_text = ahead = 0
    for prompt in PROMPTS:
        verifier.log.clear()
        out = engine.generate(prompt, greedy(MAX_NEW)).token_ids
        assert out == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        text = list(prompt) + out
        grams_at = {}  # n-gram -> start indices in text
        for i in range(len(text) - cfg.ngram + 1):
            grams_at.setdefault(tuple(text[i : i + cfg.ngram]), []).append(i)
        committed = len(prompt) + 1
        for _, result in verifier.log:
            for gram in result.feedback.ngrams:
                total += 1
                starts = grams_at.get(gram, [])
                in_text += bool(starts)
                ahead += any(s >= committed - 1 for s in starts)  # starts at the newest committed token or later
            committed += len(result.tokens)
    assert total > 100
    assert in_text / total > 0.2, (in_text, total)
    assert ahead / total > 0.1, (ahead, total)


# ============================================================================ wire
def test_cli_options():
    from verifier_service.server import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--feedback-topk", "8", "--lookahead", "4,3"])
    assert args.feedback_topk == 8 and args.lookahead == LookaheadConfig(4, 3)
    defaults = p.parse_args([])
    # top-k on by default since fused (with recycling) is the default proposer; the Jacobi window stays off
    assert defaults.feedback_topk == 8 and defaults.lookahead is None
    with pytest.raises(SystemExit):
        p.parse_args(["--lookahead", "4"])


def test_feedback_survives_the_wire(demo_stack):
    """A verifier process with feedback on answers exactly what the in-process verifier does."""
    import service_helpers as sh

    from specmesh import rpc
    from verifier_service.remote import VerifierClient

    cfg = LookaheadConfig(4, 3)
    service = sh.verifier("--feedback-topk", "4", "--lookahead", "4,3")
    try:
        service.wait_ready()
        client = VerifierClient(service.address, rpc.Security(), call_timeout=30)
        client.fetch_info(timeout=30)
        remote = client.bind(None)
        local = LocalVerifier(demo_stack.target_runner, feedback_topk=4, lookahead=cfg)
        prompt = demo_stack.tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
        sampling = greedy(24)
        first = remote.prefill("w", prompt, sampling).first_token
        assert first == local.prefill("w", prompt, sampling).first_token
        rng = random.Random(3)
        ngrams = 0
        committed = [*prompt, first]
        for step in range(6):
            tree = TokenTree.chain(committed[-6:-3]) if step % 2 else _random_tree(rng, 6)
            got, want = remote.verify("w", tree), local.verify("w", tree)
            assert got.tokens == want.tokens and got.accepted_nodes == want.accepted_nodes
            np.testing.assert_array_equal(got.feedback.inputs, want.feedback.inputs)
            np.testing.assert_array_equal(got.feedback.topk, want.feedback.topk)
            assert got.feedback.ngrams == want.feedback.ngrams
            ngrams += len(got.feedback.ngrams)
            committed += got.tokens
        assert ngrams > 0
        remote.release("w")
        client.close()
    finally:
        service.stop()
