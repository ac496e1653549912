"""The verifier step's batched host work equals its per-session definition.

- ``kv_pool.compact`` over many sessions (some moving rows, some already in place, contiguous and
  fragmented tables) leaves every session's cache as ``keep`` one session at a time does.
- The padded SDPA path (many sessions with short contexts in one call: decode rows, chains,
  trees, dense masks, sessions of different lengths, mixed with long per-session ones) gives the
  logits and KV entries of one forward per session, in a pool whose unwritten slots hold NaN.
- ``verify_greedy_chains`` equals ``verify_greedy`` on every chain (the empty tree included).
- ``packed_runs`` lists the rows of its runs in order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from spec_helpers import fragment

from specmesh import sdpa_attention
from specmesh.kv_pool import compact
from specmesh.model_runner import TreeMask, tree_attend_mask
from specmesh.padded_attention import PAD_LIMIT
from specmesh.tree import TokenTree, ancestor_mask
from verifier_service.verification import verify_greedy, verify_greedy_chains
from verifier_service.verifier import packed_runs


def _fill(runner, caches, rng: random.Random, lengths) -> None:
    """Write random keys/values at positions [0, length) of every cache (no forward needed)."""
    for cache, length in zip(caches, lengths, strict=True):
        cache.ensure(length)
        for layer in range(len(runner.layers)):
            shape = (runner.num_kv_heads, length, runner.head_dim)
            gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
            cache.write(layer, 0, torch.randn(shape, generator=gen, dtype=runner.dtype),
                        torch.randn(shape, generator=gen, dtype=runner.dtype))
        cache.length = length


@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
def test_batched_compaction_equals_per_session_keep(model_sets, fragmented):
    runner = model_sets("random").runner("target", "fast")
    rng = random.Random(11)
    pool = runner.new_pool(num_blocks=400, block_size=4)
    if fragmented:
        fragment(pool.allocator, rng)
    num = 7
    prefix = [rng.randint(1, 20) for _ in range(num)]
    rows = [rng.randint(1, 9) for _ in range(num)]
    batched = [pool.open(p + r) for p, r in zip(prefix, rows, strict=True)]
    single = [pool.open(p + r) for p, r in zip(prefix, rows, strict=True)]
    if fragmented:
        assert any(c.base is None for c in batched + single), "the pool did not fragment"
    _fill(runner, batched, random.Random(5), [p + r for p, r in zip(prefix, rows, strict=True)])
    _fill(runner, single, random.Random(5), [p + r for p, r in zip(prefix, rows, strict=True)])
    keeps = []
    for r in rows:  # ascending offsets, always the pending row 0; some are the identity (nothing moves)
        if rng.random() < 0.3:
            keeps.append(list(range(rng.randint(1, r))))
        else:
            keeps.append([0, *sorted(rng.sample(range(1, r), rng.randint(0, r - 1)))] if r > 1 else [0])
    compact(batched, prefix, keeps)
    for cache, p, keep in zip(single, prefix, keeps, strict=True):
        cache.keep(p, keep)
    for got, want, p, keep in zip(batched, single, prefix, keeps, strict=True):
        assert got.length == want.length == p + len(keep)
        for layer in range(len(runner.layers)):
            for a, b in zip(got.layer_kv(layer), want.layer_kv(layer), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def _random_tree(rng: random.Random, vocab: int, max_nodes: int) -> TokenTree:
    n = rng.randint(0, max_nodes)
    parents = [rng.randrange(-1, i) for i in range(n)]
    return TokenTree(np.array([rng.randrange(vocab) for _ in range(n)], np.int64), np.array(parents, np.int64),
                     np.ones(n))


@pytest.mark.parametrize("limit", [18, None], ids=["mixed", "all-padded"])
@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
def test_padded_attention_equals_one_forward_per_session(model_sets, monkeypatch, fragmented, limit):
    runner = model_sets("random").runner("target", "fast")
    rng = random.Random(4)
    # mixed: sessions up to 18 positions share the padded call, longer ones (and those crossing it) keep their own
    monkeypatch.setattr(sdpa_attention, "PAD_LIMIT", PAD_LIMIT if limit is None else limit * runner.kv_size)
    pool = runner.new_pool(num_blocks=400, block_size=4)
    pool.keys.fill_(float("nan"))  # what an unwritten slot may hold (the pool is torch.empty): it must never leak
    pool.values.fill_(float("nan"))
    if fragmented:
        fragment(pool.allocator, rng)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 16))] for _ in range(6)]
    prompts.append([rng.randrange(128) for _ in range(30)])
    paged = [pool.open(len(p) + 40) for p in prompts]
    single = [runner.new_cache() for _ in prompts]  # each a pool of its own
    ids, pos = np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts])
    batched = runner.forward_batch(paged, ids, pos, [len(p) for p in prompts], [None] * len(prompts))
    alone = torch.cat([runner.forward(c, p, range(len(p))) for c, p in zip(single, prompts, strict=True)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-10)
    lengths = [len(p) for p in prompts]
    for step in range(4):
        # decode rows (one each), then chains (causal), then trees (TreeMask, dense masks, None)
        rows, positions, attends = [], [], []
        for r, length in enumerate(lengths):
            tree = TokenTree.empty() if step == 0 else _random_tree(rng, 128, 6)
            if step == 1:
                tree = TokenTree.chain([rng.randrange(128) for _ in range(rng.randint(0, 5))])
            rows.append(np.concatenate([[rng.randrange(128)], tree.tokens]))
            positions.append(np.concatenate([[length], length + 1 + tree.depth]))
            anc = torch.from_numpy(ancestor_mask(np.concatenate([[-1], tree.parents + 1])))
            kind = (step + r) % 3 if step >= 2 else 2
            attends.append(TreeMask(length, anc) if kind == 0 else tree_attend_mask(length, anc) if kind == 1 else None)
            if kind == 2 and step >= 2:  # None means causal: feed the chain's version of the rows
                positions[-1] = np.arange(length, length + len(rows[-1]))
        batched = runner.forward_batch(paged, np.concatenate(rows), np.concatenate(positions),
                                       [len(r) for r in rows], attends)
        alone = torch.cat([runner.forward(c, r, q, a)
                           for c, r, q, a in zip(single, rows, positions, attends, strict=True)])
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-10)
        for cache, ref, length in zip(paged, single, lengths, strict=True):
            for layer in range(len(runner.layers)):
                for got, want in zip(cache.layer_kv(layer), ref.layer_kv(layer), strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            cache.keep(length, [0])  # commit the pending row only
            ref.keep(length, [0])
        lengths = [length + 1 for length in lengths]


def test_verify_greedy_chains_equals_verify_greedy():
    rng = np.random.default_rng(0)
    for _ in range(500):
        chains = [TokenTree.chain(rng.integers(0, 3, rng.integers(0, 6)).tolist()) for _ in range(rng.integers(1, 7))]
        packed, firsts = [], []
        outputs = []
        for chain in chains:
            packed.append(rng.integers(0, 3, rng.integers(0, 3)))  # other rows between the chains
            firsts.append(sum(len(x) for x in packed))
            outputs.append(rng.integers(0, 3, chain.num_nodes + 1))
            packed.append(outputs[-1])
        cu = np.concatenate([[0], np.cumsum([c.num_nodes for c in chains])]).astype(np.int64)
        num_accepted, bonus = verify_greedy_chains(np.concatenate(packed), np.array(firsts, np.int64),
                                                   np.concatenate([c.tokens for c in chains]), cu)
        for chain, out, count, token in zip(chains, outputs, num_accepted, bonus, strict=True):
            want = verify_greedy(chain, out)
            assert want.accepted_nodes == tuple(range(count)) and want.bonus_token == token


def test_packed_runs():
    assert packed_runs([]).tolist() == []
    assert packed_runs([(5, 2), (0, 1), (9, 0), (3, 3)]).tolist() == [5, 6, 0, 3, 4, 5]
