"""The prefix cache (specmesh/blocks.py; issue 31 item 4): full blocks of committed tokens are shared, read-only,
between sessions whose tokens start the same.

- A lookup finds the longest cached prefix, block by block; what it finds is exactly the registered prefix, even
  when every key collides or a parent block was evicted and reused (the tokens and the parent's serial are
  compared, never the key alone).
- Unreferenced cached blocks are evictable (counted free) and reclaimed least recently used first, a table's
  tail before its head (so a preempted session's prefix stays findable longest).
- Sessions sharing a prompt prefix reuse its blocks (fewer prompt tokens run), never write into them, and every
  output equals autoregressive greedy output, for several proposers, with chunked prefill, the lookahead window,
  target features (a Falcon head's session computes its whole prompt) and preemption.
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import BACKENDS, greedy, make_prompts
from test_engine_core import MAX_NEW, Collect, assert_idle, method_of, run_all

from orchestrator.core import EngineCore
from specmesh import blocks as blocks_module
from specmesh.blocks import BlockAllocator
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

SYSTEM = make_prompts(1, seed=5, min_len=70, max_len=70)[0]  # a shared "system prompt": 4 full blocks of 16
PROMPTS = [SYSTEM + tail for tail in make_prompts(6, seed=6, min_len=3, max_len=30)]


def test_lookup_finds_the_longest_registered_prefix():
    allocator = BlockAllocator(32, 4)
    tokens = list(range(100, 118))  # 4 full blocks + 2
    table = allocator.allocate(len(tokens))
    allocator.register(table, tokens, 0, 4)
    assert allocator.lookup(tokens, 4) == table[:4]
    assert allocator.lookup(tokens[:9] + [1, 2, 3, 4], 3) == table[:2]  # diverges in block 2
    assert allocator.lookup([7] + tokens[1:], 4) == []  # diverges in block 0: nothing after it matches
    assert allocator.queries == 4 * (4 + 3 + 4) and allocator.hits == 4 * (4 + 2)


def test_unreferenced_blocks_are_evictable_and_reclaimed_least_recently_used_first():
    allocator = BlockAllocator(8, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a, table_b = allocator.allocate(4), allocator.allocate(4)
    allocator.register(table_a, a, 0, 2)
    allocator.register(table_b, b, 0, 2)
    allocator.free(table_a)
    allocator.free(table_b)
    assert allocator.num_free == 8 and allocator.num_cached == 4  # free for allocation, still cached
    found = allocator.lookup(b, 2)
    allocator.share(found)  # b is used again: a is now the least recently used
    assert allocator.num_free == 6
    allocator.free(found)
    taken = allocator.allocate(2 * 6)  # needs 6 of the 4 free + 4 evictable: a's two go first
    assert allocator.lookup(a, 2) == [] and allocator.lookup(b, 2) == table_b
    allocator.free(taken)
    assert allocator.num_free == allocator.num_blocks


def test_a_collision_never_serves_another_prefix(monkeypatch):
    monkeypatch.setattr(blocks_module, "hash", lambda _: 7, raising=False)  # every key is the same
    allocator = BlockAllocator(16, 2)
    first = [1, 2, 3, 4]
    table = allocator.allocate(4)
    allocator.register(table, first, 0, 2)  # block 0 under key 7; block 1 collides: not cached
    assert allocator.lookup(first, 2) == table[:1]
    assert allocator.lookup([1, 9, 3, 4], 2) == []  # same key, other tokens: no match


def test_a_reused_parent_block_does_not_revive_its_old_children():
    allocator = BlockAllocator(2, 2)
    old = [1, 2, 3, 4]
    table = allocator.allocate(4)
    allocator.register(table, old, 0, 2)
    allocator.free(table)  # both evictable (a table's tail first)
    allocator.share(table[1:])  # the child used again (alone): the parent is now the least recently used
    allocator.free(table[1:])
    new_table = allocator.allocate(2)  # evicts the parent alone: its child stays cached
    assert new_table == table[:1] and allocator.num_cached == 1
    allocator.register(new_table, [1, 2], 0, 1)  # the same tokens again in that block, a new registration
    assert allocator.lookup(old, 2) == new_table  # the child computed under the old parent is not matched
    allocator.free(new_table)


@pytest.mark.parametrize("backend", BACKENDS)  # hf: transformers' modules on the same paged pool
def test_sessions_sharing_a_prompt_reuse_its_blocks_and_never_write_them(model_sets, ar_reference, backend):
    runner = model_sets("cyclic").runner("target", backend)
    local = LocalVerifier(runner, max_tree_nodes=8)
    size = local.allocator.block_size
    first = local.prefill("a", PROMPTS[0], greedy(MAX_NEW)).first_token
    assert first == ar_reference("cyclic", backend, PROMPTS[0], MAX_NEW)[0]
    shared = list(local._sessions["a"].cache.table[: len(SYSTEM) // size])
    keys = local.pool.keys[:, :, [b * size + o for b in shared for o in range(size)]].clone()
    run_before = local.allocator.hits
    local.prefill("b", PROMPTS[1], greedy(MAX_NEW))
    assert local.allocator.hits - run_before == len(shared) * size
    assert local._sessions["b"].cache.table[: len(shared)] == shared  # the same blocks, not copies
    assert local.num_blocks_filled == local.allocator.num_used  # a shared block holds tokens once (the KV gauge)
    for sid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        tokens = []
        for _ in range(MAX_NEW - 1):
            tokens += local.verify(sid, TokenTree.empty()).tokens
        assert tokens[: MAX_NEW - 1] == ar_reference("cyclic", backend, prompt, MAX_NEW)[1:]
    assert torch.equal(local.pool.keys[:, :, [b * size + o for b in shared for o in range(size)]], keys)
    local.release("a")
    local.release("b")
    assert local.allocator.num_free == local.allocator.num_blocks


@pytest.mark.parametrize(("proposer", "chunk"), [(None, 512), ("prompt_lookup_tree", 16), ("lookahead", 512),
                                                 ("draft_model_tree", 512), ("falcon", 512)])
def test_requests_sharing_a_system_prompt_equal_ar(model_sets, ar_reference, proposer, chunk):
    kind = "random" if proposer in ("draft_model_tree", "falcon") else "cyclic"
    ms = model_sets(kind)
    method, topk, window = method_of(proposer, ms.runner("near", "fast"))
    local = LocalVerifier(ms.runner("target", "fast"), max_tree_nodes=8, feedback_topk=topk, lookahead=window,
                          prefill_chunk=chunk)
    core = EngineCore(local)
    try:
        run_all(core, method, PROMPTS[:1], greedy(MAX_NEW))  # the system prompt's blocks are cached now
        outputs = run_all(core, method, PROMPTS, greedy(MAX_NEW))
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference(kind, "fast", prompt, MAX_NEW), proposer
        if proposer == "falcon":  # a Falcon head needs every prompt position's features: nothing reused
            assert local.allocator.hits == 0
        else:
            assert local.allocator.hits >= len(PROMPTS) * (len(SYSTEM) // 16) * 16
        assert_idle(core)
    finally:
        core.close()


def test_shared_prefixes_under_preemption_equal_ar(model_sets, ar_reference):
    from test_preemption import small_verifier

    runner = model_sets("cyclic").runner("target", "fast")
    local = small_verifier(runner, spare_blocks=1)
    core = EngineCore(local)
    try:
        prompts = 2 * [SYSTEM[:13] + p[len(SYSTEM) : len(SYSTEM) + 3] for p in PROMPTS]  # 3 shared blocks of 4
        outputs = [Collect() for _ in prompts]
        for prompt, out in zip(prompts, outputs, strict=True):
            core.submit(prompt, greedy(MAX_NEW), method_of("prompt_lookup_tree")[0], out)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.done.wait(120) and out.error is None, out.error
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        assert core.stats.preemptions > 0 and local.allocator.hits > 0
        assert_idle(core)
    finally:
        core.close()


def test_a_freed_tables_tail_is_evicted_before_its_head():
    allocator = BlockAllocator(3, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    table = allocator.allocate(6)
    allocator.register(table, tokens, 0, 3)
    allocator.free(table)
    taken = allocator.allocate(2)  # one block: the tail's
    assert taken == table[2:] and allocator.lookup(tokens, 3) == table[:2]
    allocator.free(taken)


def test_a_mostly_cached_prompt_is_admitted_on_the_blocks_it_takes(model_sets, ar_reference):
    from verifier_service.step_loop import StepLoop

    runner = model_sets("cyclic").runner("target", "fast")
    local = LocalVerifier(runner, max_tree_nodes=8, block_size=4, kv_cache_gb=24 * 4 * runner.kv_bytes_per_token / 2**30)
    loop = StepLoop(local)
    try:
        prompt = (PROMPTS[0] * 2)[:60]  # 15 blocks of the pool's 24
        loop.prefill("a", prompt, greedy(8))
        assert local.allocator.num_free == 9
        other = prompt[:56] + [5, 6, 7, 8]  # its first 14 blocks are a's: it takes one block, not 15
        first = loop.submit_prefill("b", other, greedy(8)).result(timeout=30)
        assert first.first_token == ar_reference("cyclic", "fast", other, 8)[0]
        assert loop.num_waiting == 0 and local.allocator.num_free == 8
        for sid in ("a", "b"):
            loop.release(sid)
        assert local.allocator.num_free == local.allocator.num_blocks
    finally:
        loop.close()
