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
    LookaheadConfig,
    Window,
    branch_parents,
    fill,
    harvest,
    initial_window,
    note_successors,
    rows_are_causal,
    shift_window,
    window_positions,
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
    assert LookaheadConfig(4, 3).levels == 2 and LookaheadConfig(4, 3).rows == 8
    for bad in ["4", "4,3,2", "a,3", "0,3", "4,1", ""]:
        with pytest.raises(ValueError):
            LookaheadConfig.parse(bad)
    with pytest.raises(ValueError):
        LookaheadConfig(2.5, 3)


def test_window_is_a_comb_off_the_pending_token_beside_the_tree():
    """(l, i) sees the pending token, level 0 up to column i - 1 and its own column up to level l; positions
    are prefix_len + depth; the tree never sees the window and the window never sees the tree."""
    tree_parents = np.array([-1, -1, 0, 2], np.int64)  # nodes 0, 1 under pending; 2 under 0; 3 under 2
    span, levels = 3, 2
    anc = ancestor_mask(branch_parents(tree_parents, span, levels))  # rows: pending, 4 nodes, 2 x 3 window
    assert anc.shape == (11, 11)
    row = {(lv, i): 5 + lv * span + i for lv in range(levels) for i in range(span)}
    for (lv, i), r in row.items():
        want = {0} | {row[0, j] for j in range(i)} | {row[m, i] for m in range(lv + 1)}
        assert set(anc[r].nonzero()[0].tolist()) == want, (lv, i)
    for r in range(1, 5):  # the tree never sees the window
        assert not anc[r, 5:].any() and anc[r, 0]
    np.testing.assert_array_equal(anc[:5, :5], ancestor_mask([-1, *(tree_parents + 1).tolist()]))
    depth = anc.sum(axis=1) - 1  # ancestors below the pending token
    np.testing.assert_array_equal(window_positions(100, span, levels), 100 + depth[5:])
    assert branch_parents(tree_parents, 0, levels) == [-1, 0, 0, 1, 3]
    assert branch_parents(np.zeros(0, np.int64), 2) == [-1, 0, 1]  # one level: a chain


def test_causal_only_for_one_chain_in_row_order():
    assert rows_are_causal(3, True, 0, 2)  # a chain, no window
    assert rows_are_causal(0, True, 4, 1)  # the one-level window alone
    assert rows_are_causal(0, True, 1, 3)  # one column
    assert not rows_are_causal(0, True, 2, 2)  # a comb
    assert not rows_are_causal(2, True, 1, 1)  # chain + window: two branches
    assert not rows_are_causal(3, False, 0, 1)


def test_window_span_shrinks_at_the_context_end():
    cfg = LookaheadConfig(4, 3)  # the top of column i at prefix_len + i + 2
    assert window_span(10, cfg, 100) == 4
    assert window_span(95, cfg, 100) == 3  # columns 0..2: tops at 97, 98, 99
    assert window_span(98, cfg, 100) == 0
    assert window_span(96, LookaheadConfig(4, 2), 100) == 3  # one level: positions 97, 98, 99


def _window(tokens, predicted=True) -> Window:
    tokens = np.asarray(tokens, np.int64)
    return Window(tokens, np.broadcast_to(np.asarray(predicted, bool), tokens.shape).copy())


def test_shift_moves_each_guess_with_its_position_and_fills_the_rest():
    successors = {5: 6, 6: 7}
    win = _window([[10, 11, 12, 13], [20, 21, 22, 23]])  # N = 3, W = 4: (l, i) at P+1+i+l
    outputs = np.array([30, 31, 32, 33])  # guesses for P+3..P+6
    # nothing accepted, bonus at P+1: plain Jacobi, the window climbs one level
    new = shift_window(win, outputs, 0, 99, successors)
    np.testing.assert_array_equal(new.tokens, [[20, 21, 22, 23], [30, 31, 32, 33]])
    assert new.predicted.all()
    # two accepted + bonus (at P+3): (0, i) at P+4+i takes old (1, i+2), the top old outputs[2:];
    # the rest continue level 0 / their column by successors (33 and 23 have none)
    new = shift_window(win, outputs, 2, 5, successors)
    np.testing.assert_array_equal(new.tokens, [[22, 23, 23, 23], [32, 33, 23, 23]])
    np.testing.assert_array_equal(new.predicted, [[1, 1, 0, 0], [1, 1, 0, 0]])
    # more committed than the window covers: all fills, level 0 a bigram chain from the bonus
    new = shift_window(win, outputs, 5, 5, successors)
    np.testing.assert_array_equal(new.tokens, [[6, 7, 7, 7], [7, 7, 7, 7]])
    assert not new.predicted.any()
    # a cropped window (span 2 < W): the unfed columns' older levels still move
    new = shift_window(win, outputs[:2], 0, 99, successors)
    np.testing.assert_array_equal(new.tokens, [[20, 21, 22, 23], [30, 31, 22, 23]])
    np.testing.assert_array_equal(new.predicted, [[1, 1, 1, 1], [1, 1, 0, 0]])


def test_fills_and_initial_window_follow_the_most_recent_successor():
    successors: dict[int, int] = {}
    note_successors(successors, [1, 2, 3, 1, 4])
    assert successors == {1: 4, 2: 3, 3: 1}
    assert fill(3, 5, successors) == [1, 4, 4, 4, 4]
    win = initial_window(2, LookaheadConfig(3, 3), successors)
    np.testing.assert_array_equal(win.tokens, [[3, 1, 4], [1, 4, 4]])
    assert not win.predicted.any()


def test_harvest_takes_columns_predicted_above_level_zero_once():
    win = _window([[9, 1, 1, 1], [2, 5, 2, 2]], [[0, 0, 0, 0], [1, 0, 1, 1]])
    assert harvest(win, np.array([3, 6, 3, 4])) == [(9, 2, 3), (1, 2, 3), (1, 2, 4)]
    assert harvest(win, np.zeros(0, np.int64)) == []
    one_level = _window([[4, 5]], False)  # N = 2: every column is a bigram
    assert harvest(one_level, np.array([7, 8])) == [(4, 7), (5, 8)]


# ============================================================ the window, simulated
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
def test_window_simulation_keeps_positions_and_harvests_jacobi_ngrams(window, ngram, vocab, seed, context_end):
    """Run the window with the pure functions against a fake target that reads each row's context as the
    forward does (the committed tokens, then level 0 before the column, then the column up to the row).
    Every entry keeps its absolute position through the shifts; every harvested n-gram is a column fed
    plus the target's prediction after it, and each link of it was predicted by the target right after
    its predecessor (in this or an earlier iteration)."""
    rng = random.Random(seed)
    cfg = LookaheadConfig(window, ngram)
    context = [rng.randrange(vocab) for _ in range(rng.randint(2, 8))]  # committed, pending last
    successors: dict[int, int] = {}
    note_successors(successors, context)
    win = initial_window(context[-1], cfg, successors)
    links: set[tuple[int, int]] = set()  # (last input token, output) of every prediction made
    made: list[dict[int, int]] = []  # iteration -> {position: the target's guess for it}
    while len(context) < context_end:
        prefix_len = len(context) - 1  # the pending token sits at prefix_len
        span = window_span(prefix_len, cfg, context_end + 2)
        t = len(made)
        for lv in range(cfg.levels):  # a predicted entry of level l was guessed L - l iterations ago
            for i in range(window):
                if win.predicted[lv, i]:
                    assert made[t - (cfg.levels - lv)][prefix_len + 1 + i + lv] == win.tokens[lv, i]
        outputs = []
        for i in range(span):
            seen = tuple(context + win.tokens[0, :i].tolist() + win.tokens[:, i].tolist())
            outputs.append(_fake_target(seen, vocab))
            links.add((seen[-1], outputs[-1]))
        made.append({prefix_len + 1 + i + cfg.levels: o for i, o in enumerate(outputs)})
        got = harvest(win, np.asarray(outputs, np.int64))
        want = []
        for i in range(span):
            gram = (*win.tokens[:, i].tolist(), outputs[i])
            if win.predicted[1:, i].all() and gram not in want:
                want.append(gram)
        assert got == want and all(len(g) == ngram for g in got)
        for gram in got:
            assert all((a, b) in links for a, b in zip(gram, gram[1:], strict=False))
        committed = [rng.randrange(vocab) for _ in range(rng.randint(1, window + 2))]  # accepted + bonus
        note_successors(successors, [context[-1], *committed])
        win = shift_window(win, np.asarray(outputs, np.int64), len(committed) - 1, committed[-1], successors)
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


@pytest.mark.parametrize("cfg", [LookaheadConfig(5, 2), LookaheadConfig(4, 4)], ids=_cfg_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_rows_are_jacobi_iterations(model_sets, backend, cfg):
    """Beside random trees, the argmax after the top of window column i is the target's argmax after the
    committed tokens + level 0 up to column i - 1 + column i (positions and mask right, no tree node
    seen); the shifted window's top level holds those outputs for the positions still ahead."""
    ms = model_sets("cyclic")
    verifier = LocalVerifier(ms.runner("target", backend), lookahead=cfg)
    rng = random.Random(11)
    checked = 0
    for s, prompt in enumerate(PROMPTS[:3]):
        committed = list(prompt) + [verifier.prefill(f"s{s}", prompt, greedy(MAX_NEW)).first_token]
        for _ in range(6):
            win = verifier._sessions[f"s{s}"].window.tokens
            naive = [_naive_topk(ms.target, committed + win[0, :i].tolist() + win[:, i].tolist(), 1)[0]
                     for i in range(cfg.window)]
            result = verifier.verify(f"s{s}", _random_tree(rng, 8))
            a = result.num_accepted
            new = verifier._sessions[f"s{s}"].window
            assert new.tokens[-1, : cfg.window - a].tolist() == naive[a:], (s, a)
            assert new.predicted[-1, : cfg.window - a].all()
            checked += cfg.window - a
            committed += result.tokens
    assert checked > 30


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_sessions_with_their_own_feedback_share_one_step(model_sets, backend):
    """Issue 67: top-k feedback and the lookahead window are per-row options of one batch. Sessions asking for
    top-5, top-2, a window, both, or nothing step together in one verifier (defaults off), each verified row's
    results equal those of a verifier configured for that session alone, and each session's tokens are its own."""
    runner = model_sets("random").runner("target", backend)
    window = LookaheadConfig(3, 3)
    asks = [(5, None), (2, None), (0, window), (5, window), (None, None)]  # (feedback_topk, lookahead)
    shared = LocalVerifier(runner, max_window_rows=window.rows)
    alone = [LocalVerifier(runner, feedback_topk=k or 0, lookahead=w) for k, w in asks]
    rng = random.Random(3)
    for s, ((k, w), prompt) in enumerate(zip(asks, PROMPTS, strict=False)):
        shared.admit(f"s{s}", prompt, greedy(MAX_NEW), feedback_topk=k, lookahead=w)
        alone[s].prefill(f"s{s}", prompt, greedy(MAX_NEW))
    firsts = {}
    while len(firsts) < len(asks):
        firsts.update(shared.step([f"s{s}" for s in range(len(asks)) if f"s{s}" not in firsts], ())[0])
    for _ in range(4):
        trees = [_random_tree(rng, 6) for _ in asks]
        _, batched = shared.step((), [(f"s{s}", tree) for s, tree in enumerate(trees)])
        for s, ((k, w), tree, result) in enumerate(zip(asks, trees, batched, strict=True)):
            one = alone[s].verify(f"s{s}", tree)
            assert result.tokens == one.tokens
            if not k and w is None:
                assert result.feedback is None
                continue
            assert result.feedback.k == (k or 0) and np.array_equal(result.feedback.topk, one.feedback.topk)
            assert result.feedback.ngrams == one.feedback.ngrams
    with pytest.raises(ValueError, match="larger than this verifier's"):
        shared.admit("big", PROMPTS[0], greedy(MAX_NEW), lookahead=LookaheadConfig(4, 4))


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
