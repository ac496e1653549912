"""The draft model's KV in one paged pool of the draft runner (drafter_service/draft_kv.py).

The pool is a cache: under pressure idle sessions' draft caches are emptied and re-read later, a session whose
step cannot get blocks drafts nothing, and neither ever changes an output. So the tests hold greedy output to
plain decoding on pools far too small for the load, check which caches are emptied (idle ones, least recently
used first, never one a step holds), and that every block comes back when the sessions end.
"""

from __future__ import annotations

import pytest
from spec_helpers import engine_for, greedy, make_prompts, make_runner

from drafter_service.draft_kv import DraftKV, draft_kv
from drafter_service.draft_model import DraftModelProposer
from drafter_service.drafter import LocalDrafter
from drafter_service.metrics import DrafterMetrics
from drafter_service.mjsd import MJSDProposer
from drafter_service.proposer import DraftSessionState
from orchestrator.drafter_link import only
from orchestrator.policy import StaticPolicy
from specmesh.blocks import DEFAULT_BLOCK_SIZE
from specmesh.contract import Budget
from verifier_service.verifier import LocalVerifier

PROMPTS = make_prompts(6, seed=29, min_len=20, max_len=50)


def pool_of(runner, blocks: int) -> DraftKV:
    """A DraftKV whose pool has exactly ``blocks`` blocks."""
    kv = DraftKV(runner, (blocks + 0.5) * runner.kv_bytes_per_token * DEFAULT_BLOCK_SIZE / 2**30)
    assert kv.pool.allocator.num_blocks == blocks
    return kv


def test_idle_caches_make_room_least_recently_used_first_and_held_ones_never(model_sets):
    runner = make_runner(model_sets("random").near, "fast")
    kv = pool_of(runner, 6)
    a, b, c = kv.new(), kv.new(), kv.new()
    for dc, tokens in ((a, 20), (b, 20), (c, 20)):  # 2 blocks each: the pool is full
        with kv.hold([dc], [tokens]) as ok:
            assert ok == [True]
            dc.cached, dc.cache.length = list(range(tokens)), tokens  # as a forward of them leaves it
    assert kv.blocks_used == 6
    with kv.hold([c], [20]):  # c is now the most recently used; a the least
        pass
    d = kv.new()
    with kv.hold([d], [30]) as ok:  # 2 blocks: a goes (LRU), b stays
        assert ok == [True] and kv.evictions == 1
        assert a.cached == [] and not a.cache.table and b.cached and c.cached
        with kv.hold([b], [50]) as inner:  # b needs 2 more blocks: only c is idle (d is held)
            assert inner == [True] and c.cached == [] and d.cache.table
    with kv.hold([a, b], [100, 10]) as ok:  # a cannot get 7 blocks in a pool of 6; b keeps its own
        assert ok == [False, True] and a.cached == [] and not a.cache.table and b.cache.table
    assert kv.starved == 1
    registry = DrafterMetrics(sessions=dict, model_name="m", draft_kv=kv).registry  # read at scrape time
    assert registry.get_sample_value("specmesh_drafter_kv_usage_perc", {"model_name": "m"}) == kv.blocks_used / 6
    assert registry.get_sample_value("specmesh_drafter_kv_evictions_total", {"model_name": "m"}) == 2
    assert registry.get_sample_value("specmesh_drafter_kv_starved_total", {"model_name": "m"}) == 1
    for dc in (a, b, c, d):
        kv.release(dc)
    assert kv.blocks_used == 0
    assert registry.get_sample_value("specmesh_drafter_kv_usage_perc", {"model_name": "m"}) == 0


def test_a_session_ending_during_its_draft_step_frees_its_blocks_after_it(model_sets):
    """A session may end on one thread while another drafts its next tree: its blocks stay its own until the
    step lets go (no other session can take them mid-forward), then go back."""
    runner = make_runner(model_sets("random").near, "fast")
    kv = pool_of(runner, 4)
    dc, other = kv.new(), kv.new()
    with kv.hold([dc], [30]) as ok:
        assert ok == [True]
        kv.release(dc)
        assert kv.blocks_used == 2 and dc.cache.table
        with kv.hold([other], [60]) as got:  # 4 blocks: the released, still held cache is not evicted for it
            assert got == [False]
    assert kv.blocks_used == 0 and not dc.cache.table


def test_a_draft_runner_has_one_pool_of_one_size(model_sets):
    runner = make_runner(model_sets("random").near, "fast")
    kv = draft_kv(runner, 0.01)
    assert draft_kv(runner) is kv and draft_kv(runner, 0.01) is kv
    assert DraftModelProposer(runner).kv is kv and MJSDProposer(runner).kv is kv
    with pytest.raises(ValueError, match="already has"):
        draft_kv(runner, 0.02)
    with pytest.raises(ValueError, match="> 0 GiB"):
        DraftKV(runner, 0)
    assert kv.capacity_tokens == kv.pool.allocator.num_blocks * DEFAULT_BLOCK_SIZE


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_proposals_after_eviction_equal_proposals_from_a_fresh_pool(model_sets, tree):
    """Sessions take turns on a pool that holds one of them: each proposal re-reads an evicted context and
    drafts what a proposer with room for everyone drafts."""
    ms = model_sets("random")
    runner = make_runner(ms.near, "fast")
    small = DraftModelProposer(runner, tree=tree, branching=3, expand_width=2, kv=pool_of(runner, 6))
    roomy = DraftModelProposer(runner, tree=tree, branching=3, expand_width=2, kv=DraftKV(runner, 0.01))
    budget = Budget(8, 4)
    states = [(DraftSessionState(str(i), list(p), greedy(8)), DraftSessionState(str(i), list(p), greedy(8)))
              for i, p in enumerate(PROMPTS[:4])]
    for round_ in range(3):
        for s_small, s_roomy in states:
            got, want = small.propose(s_small, budget), roomy.propose(s_roomy, budget)
            assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
            for s in (s_small, s_roomy):
                s.tokens += [int(t) for t in want.tokens[: round_ + 1]]
        batched = small.propose_batch([s for s, _ in states], [budget] * len(states))  # only some fit at once
        assert any(t.num_nodes == 0 for t in batched) and any(t.num_nodes for t in batched)
    assert small.kv.evictions > 0 and small.kv.starved > 0
    for s_small, s_roomy in states:
        small.release(s_small)
        roomy.release(s_roomy)
    assert small.kv.blocks_used == 0 and roomy.kv.blocks_used == 0


@pytest.mark.parametrize("proposer", ["chain", "tree", "mjsd"])
def test_greedy_equals_ar_with_a_draft_pool_smaller_than_the_load(model_sets, proposer):
    """Six requests in one engine core, batched drafting, on a draft pool of 8 blocks (about two sessions'
    contexts): caches are evicted and (batched) some sessions draft nothing, the outputs are plain decoding's, and the pool is empty
    once the requests are done."""
    from orchestrator.core import EngineCore
    from orchestrator.requests import Method, QueueOutput

    ms = model_sets("random")
    target, runner = ms.runner("target", "fast"), make_runner(ms.near, "fast")
    kv = pool_of(runner, 8)
    prop = (MJSDProposer(runner, kv=kv) if proposer == "mjsd" else
            DraftModelProposer(runner, tree=proposer == "tree", branching=3, expand_width=2, kv=kv))
    drafted = []
    propose_batch = prop.propose_batch

    def counted(states, budgets):
        trees = propose_batch(states, budgets)
        drafted.extend(t.num_nodes for t in trees)
        return trees

    prop.propose_batch = counted
    ar = engine_for(target)
    want = [ar.generate(p, greedy(24)).token_ids for p in PROMPTS]
    core = EngineCore(LocalVerifier(target))
    try:
        method = Method(only(LocalDrafter(prop), prop.name), StaticPolicy(8, 4), strict=True)
        outputs = [QueueOutput() for _ in PROMPTS]
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            core.submit(prompt, greedy(24), method, output)
        got = [[t for event in output.events() for t in event.tokens] for output in outputs]
    finally:
        core.close()
    assert got == want
    assert kv.evictions > 0 and sum(drafted) > 0
    if proposer != "mjsd":  # batched: not every session fits at once (mjsd drafts one session at a time)
        assert kv.starved > 0 and drafted.count(0) > 0
    assert kv.blocks_used == 0
