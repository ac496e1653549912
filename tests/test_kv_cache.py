"""KV caches after tree steps equal a fresh causal prefill of the tokens they claim to hold.

Verifier: after every verify step, the session cache holds exactly the committed tokens
minus the pending one. Draft model proposer: after every proposal, its scratch cache holds
exactly ``scratch.cached``. Compaction of non-chain trees (gathering the accepted path out
of the tree's positions) is forced with an oracle drafter whose true path sits behind
decoy siblings.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from spec_helpers import (
    BACKENDS,
    OracleProposer,
    RecordingVerifier,
    assert_cache_matches,
    drafter_of,
    engine_for,
    fresh_kv,
    greedy,
    layer_kv,
    make_prompts,
)

from specmesh.kv_pool import GROW_CHUNK, PagedKVCache
from specmesh.model_runner import tree_attend_mask
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

PROMPTS = make_prompts(6, seed=3)
MAX_NEW = 30


def _only(d: dict):
    assert len(d) == 1, f"expected one live session, found {len(d)}"
    return next(iter(d.values()))


def _run_and_check(engine, verifier, prompt, sampling, draft_runner=None, draft_name=None):
    """Stream one request; after each step compare the verifier (and draft) caches with fresh prefills."""
    target_runner = verifier.runner
    committed = list(prompt)
    gathered = 0
    checked_draft = 0
    for event in engine.stream(prompt, sampling):
        session = _only(verifier._sessions)
        if event.step is None:
            committed.append(session.pending)
        else:
            tree, result = verifier.log[-1]
            committed += result.tokens
            gathered += result.accepted_nodes != tuple(range(result.num_accepted))
        assert committed[-1] == session.pending
        assert_cache_matches(session.cache, fresh_kv(target_runner, committed[:-1]), "verifier cache")
        if draft_name is not None and drafter_of(engine) is not None and drafter_of(engine)._sessions:
            state = _only(drafter_of(engine)._sessions)
            dc = state.scratch.get(draft_name)
            if dc is not None:
                # committed first (all of them, or all but the last right after the prefill at open),
                # then any drafted tokens
                n = min(len(dc.cached), len(state.tokens))
                assert n >= len(state.tokens) - 1 and dc.cached[:n] == state.tokens[:n]
                assert_cache_matches(dc.cache, fresh_kv(draft_runner, dc.cached), "draft cache")
                checked_draft += 1
    return gathered, checked_draft


@pytest.mark.parametrize("backend", BACKENDS)
def test_verifier_cache_after_oracle_trees_with_decoys(model_sets, ar_reference, backend):
    ms = model_sets("random")
    runner = ms.runner("target", backend)
    seqs = [p + ar_reference("random", backend, p, MAX_NEW) for p in PROMPTS]
    verifier = RecordingVerifier(runner)
    engine = engine_for(runner, OracleProposer(seqs, decoys=3), 20, 4, verifier=verifier)
    gathered = 0
    for prompt in PROMPTS[:3]:
        gathered += _run_and_check(engine, verifier, prompt, greedy(MAX_NEW))[0]
    assert gathered >= 10  # compaction really had to gather non-contiguous positions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("proposer", ["draft_model", "draft_model_tree"])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_verifier_and_draft_caches_follow_committed_tokens(model_sets, proposer, mode, backend):
    ms = model_sets("random")
    runner, draft = ms.runner("target", backend), ms.runner("near", backend)
    verifier = RecordingVerifier(runner)
    engine = engine_for(runner, proposer, 12, 5, draft_runner=draft, verifier=verifier)
    checked = accepted = 0
    for i, prompt in enumerate(PROMPTS[:3]):
        sp = greedy(MAX_NEW) if mode == "greedy" else SamplingParams(temperature=1.0, seed=i, max_new_tokens=MAX_NEW, ignore_eos=True)
        verifier.log.clear()
        checked += _run_and_check(engine, verifier, prompt, sp, draft, proposer)[1]
        accepted += sum(r.num_accepted for _, r in verifier.log)
    assert checked > 10 and accepted > 0


def _random_tree_forward(runner, rng, max_prefix: int, min_nodes: int, max_nodes: int):
    """Prefill a random prefix, then run one forward over a random tree on top of it.

    Returns (prefix, tree, cache, tree logits [num_nodes, vocab])."""
    prefix = [rng.randrange(128) for _ in range(rng.randint(1, max_prefix))]
    n = rng.randint(min_nodes, max_nodes)
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    tree = TokenTree(np.asarray([rng.randrange(128) for _ in range(n)], np.int64), np.asarray(parents, np.int64), np.ones(n))
    cache = runner.new_cache()
    runner.forward(cache, prefix, range(len(prefix)))
    attend = tree_attend_mask(len(prefix), torch.from_numpy(tree.ancestor_mask))
    logits = runner.forward(cache, tree.tokens.tolist(), tree.position_ids(len(prefix)).tolist(), attend)
    return prefix, tree, cache, logits



@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_gathers_any_root_to_node_path(model_sets, backend):
    """One tree forward on top of a prefix, then keep(path): the cache equals a prefill of prefix + path."""
    ms = model_sets("random")
    runner = ms.runner("target", backend)
    rng = random.Random(0)
    for trial in range(12):
        prefix, tree, cache, _ = _random_tree_forward(runner, rng, max_prefix=30, min_nodes=1, max_nodes=12)
        n = tree.num_nodes
        path = tree.path_to(rng.randrange(n))
        cache.keep(len(prefix), path)
        kept = prefix + [int(tree.tokens[i]) for i in path]
        assert_cache_matches(cache, fresh_kv(runner, kept), f"trial {trial}, path {path}")
        # and the cache keeps working: one more token gives the logits of a fresh full forward
        nxt = rng.randrange(128)
        got = runner.forward(cache, [nxt], [len(kept)])[-1]
        ref_cache = runner.new_cache()
        want = runner.forward(ref_cache, kept + [nxt], range(len(kept) + 1))[-1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_forward_logits_equal_sequential_forward_of_each_path(model_sets, backend):
    """The logits of every tree node equal those of a causal forward over prefix + that node's path."""
    ms = model_sets("random")
    runner = ms.runner("target", backend)
    rng = random.Random(1)
    for _ in range(6):
        prefix, tree, cache, logits = _random_tree_forward(runner, rng, max_prefix=20, min_nodes=2, max_nodes=10)
        n = tree.num_nodes
        for i in range(n):
            seq = prefix + [int(tree.tokens[j]) for j in tree.path_to(i)]
            want = runner.forward(runner.new_cache(), seq, range(len(seq)))[-1]
            torch.testing.assert_close(logits[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_moves_only_the_accepted_rows_in_place(model_sets, backend):
    """Compaction to a non-prefix path writes the kept tree rows below the prefix; the prefix is not copied."""
    runner = model_sets("random").runner("target", backend)
    cache = runner.new_cache()
    runner.forward(cache, list(range(1, 21)), range(20))
    tree = TokenTree(np.asarray([30, 31, 32, 33]), np.asarray([-1, 0, -1, 2]), np.ones(4))  # two chains
    runner.forward(cache, tree.tokens, tree.position_ids(20), tree_attend_mask(20, torch.from_numpy(tree.ancestor_mask)))
    layers = runner.model.config.num_hidden_layers
    before = [tuple(t.clone() for t in layer_kv(cache, i)) for i in range(layers)]
    storages = [layer_kv(cache, i)[0].untyped_storage().data_ptr() for i in range(layers)]
    cache.keep(20, [2, 3])
    assert cache.length == 22
    for i in range(layers):
        keys, values = layer_kv(cache, i)
        assert keys.untyped_storage().data_ptr() == storages[i]  # rows moved within the same buffer
        torch.testing.assert_close(keys, torch.cat([before[i][0][:, :20], before[i][0][:, 22:24]], dim=1))
        torch.testing.assert_close(values, torch.cat([before[i][1][:, :20], before[i][1][:, 22:24]], dim=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_of_its_own_grows_and_keeps_its_positions(model_sets, backend):
    """``new_cache``: a PagedKVCache in a pool of its own, GROW_CHUNK positions to start with, that grows (its
    tensors reallocated) as the session does, across chunks, a tree step with compaction and decode rows: its
    keys/values and logits stay those of a session in a pool sized once; ``free`` empties it and it grows again."""
    runner = model_sets("random").runner("target", backend)
    rng = random.Random(6)
    tokens = [rng.randrange(128) for _ in range(400)]
    cache = runner.new_cache()
    assert isinstance(cache, PagedKVCache) and not cache.pool.fixed
    assert cache.pool.allocator.num_blocks * cache.pool.block_size == GROW_CHUNK and cache.table == []
    fixed = runner.new_pool(num_blocks=40, block_size=16).open(0)
    tree = TokenTree(np.asarray([5, 6, 7]), np.asarray([-1, -1, 1]), np.ones(3))
    for c in (cache, fixed):
        runner.forward(c, tokens[:200], range(200))
        runner.forward(c, tokens[200:300], range(200, 300))  # past the first chunk: the pool grows
        runner.forward(c, tree.tokens, tree.position_ids(300),
                       tree_attend_mask(300, torch.from_numpy(tree.ancestor_mask)))
        c.keep(300, [1, 2])
        c.trim()
    steps = [[runner.forward(c, [t], [302 + i])[0] for i, t in enumerate(tokens[300:320])] for c in (cache, fixed)]
    torch.testing.assert_close(torch.stack(steps[0]), torch.stack(steps[1]), rtol=1e-6, atol=1e-6)
    assert cache.length == 322 and cache.base == 0 and cache.table == list(range(len(cache.table)))
    assert cache.pool.allocator.num_blocks >= 2 * GROW_CHUNK // cache.pool.block_size  # at least doubled
    assert_cache_matches(cache, [layer_kv(fixed, i) for i in range(runner.model.config.num_hidden_layers)],
                         "grown cache")
    assert cache.free() == len(fixed.table) and cache.length == 0
    runner.forward(cache, tokens[:330], range(330))  # empty again, it takes blocks 0, 1, ... again
    assert cache.base == 0 and cache.length == 330
