"""KV blocks taken per step, and preemption instead of refusal (issue 31).

On a pool a few blocks larger than one request's largest footprint, eight concurrent requests cannot all hold
their KV: the step loop preempts the most recently admitted session (its blocks back to the pool) and resumes
it later by computing its positions again. Nothing of that may change an output:

- greedy output equals autoregressive greedy output for every proposer, drafting then verifying and overlapped
  (PEARL), in process and over gRPC (a replica's caller sessions: their Verify waits while preempted);
- a seeded sampled request draws the same tokens with and without preemption;
- the pool is empty again after every request ended (done, cancelled, preempted on the way), also over random
  interleavings of admissions, steps, preemptions and releases (a property test on ``LocalVerifier``);
- the context served is what one request alone can hold, so every admitted request finishes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import greedy
from test_engine_core import MAX_NEW, PROMPTS, Collect, assert_idle, method_of, run_all
from test_remote_core import replica_core

from drafter_service.proposer import proposer_names, proposer_spec
from orchestrator.core import EngineCore
from specmesh.contract import SessionPreemptedError
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.step_loop import StepLoop
from verifier_service.verifier import LocalVerifier

TREE = 8  # the tests' largest tree (their policies draft at most 8 nodes)
BLOCK = 4


def small_verifier(runner, topk: int = 0, window=None, spare_blocks: int = 3) -> LocalVerifier:
    """A verifier whose pool holds the longest request's largest footprint and ``spare_blocks`` more: a few
    requests at a time, so eight concurrent ones preempt each other."""
    rows = 1 + TREE + (window.rows if window is not None else 0)
    footprint = max(len(p) for p in PROMPTS) + MAX_NEW + rows
    blocks = -(-footprint // BLOCK) + spare_blocks
    return LocalVerifier(runner, max_tree_nodes=TREE, feedback_topk=topk, lookahead=window, block_size=BLOCK,
                         kv_cache_gb=blocks * BLOCK * runner.kv_bytes_per_token / 2**30)


def kind_for(proposer: str | None) -> str:
    return "random" if proposer and proposer_spec(proposer).needs_draft_model else "cyclic"


@pytest.mark.parametrize(("proposer", "overlap"), [(p, o) for p in (None, *proposer_names()) for o in (False, True)])
def test_greedy_equals_ar_under_forced_preemption(model_sets, ar_reference, proposer, overlap):
    kind = kind_for(proposer)
    ms = model_sets(kind)
    method, topk, window = method_of(proposer, ms.runner("near", "fast"), overlap=overlap)
    core = EngineCore(small_verifier(ms.runner("target", "fast"), topk, window))
    try:
        outputs = run_all(core, method, PROMPTS, greedy(MAX_NEW), stagger=0.0)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference(kind, "fast", prompt, MAX_NEW), proposer
            assert out.result.finish_reason == "length"
        assert core.stats.preemptions > 0, "the pool never ran short"
        assert core.stats.max_batch > 1, "no two requests were ever verified in one forward"
        assert_idle(core)
    finally:
        core.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("proposer", [None, "prompt_lookup_tree", "draft_model_tree"])
def test_seeded_sampling_is_the_same_with_and_without_preemption(model_sets, proposer, overlap):
    ms = model_sets("random")
    runner = ms.runner("target", "fast")
    base = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=MAX_NEW, ignore_eos=True)
    tokens = {}
    for pool in ("roomy", "small"):
        method = method_of(proposer, ms.runner("near", "fast"), overlap=overlap)[0]
        core = EngineCore(LocalVerifier(runner, max_tree_nodes=TREE) if pool == "roomy" else small_verifier(runner))
        try:
            outputs = [Collect() for _ in PROMPTS]
            for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
                core.submit(prompt, dataclasses.replace(base, seed=100 + i), method, out)
            for out in outputs:
                assert out.done.wait(120) and out.error is None, out.error
            tokens[pool] = [o.tokens for o in outputs]
            if pool == "small":
                assert core.stats.preemptions > 0, "the pool never ran short"
            assert_idle(core)
        finally:
            core.close()
    assert tokens["small"] == tokens["roomy"]


def test_cancelling_preempted_requests_frees_everything(model_sets):
    runner = model_sets("cyclic").runner("target", "fast")
    local = small_verifier(runner, spare_blocks=1)
    core = EngineCore(local)
    try:
        outputs = [Collect() for _ in PROMPTS]
        context = local.info.max_positions  # each runs to the end of the context served: they never finish first
        ids = [core.submit(p, greedy(context - len(p)), method_of(None)[0], o)
               for p, o in zip(PROMPTS, outputs, strict=True)]
        while core.stats.preemptions == 0:
            assert not any(o.done.is_set() for o in outputs)
            outputs[0].done.wait(0.01)
        for request_id in ids:
            core.cancel(request_id)
        for out in outputs:
            assert out.done.wait(30) and out.error is None
            assert out.result.finish_reason == "aborted"
        assert_idle(core)
    finally:
        core.close()


def test_a_replicas_callers_equal_ar_under_preemption(model_sets, ar_reference):
    """Over gRPC: an engine core on a replica whose pool is small; the replica preempts its callers' sessions
    (a VerifyBatch item whose session is preempted ends at once and is sent again) and every request still gets
    its AR greedy output."""
    runner = model_sets("cyclic").runner("target", "fast")
    step_loop = StepLoop(small_verifier(runner))
    with replica_core(step_loop, call_timeout=60) as (_, core):
        for proposer in (None, "prompt_lookup_tree"):
            outputs = run_all(core, method_of(proposer)[0], PROMPTS, greedy(MAX_NEW), stagger=0.0)
            for prompt, out in zip(PROMPTS, outputs, strict=True):
                assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW), proposer
        assert step_loop.stats.preemptions > 0, "the replica's pool never ran short"
    allocator = step_loop.verifier.allocator
    assert allocator.num_free == allocator.num_blocks



def test_a_verify_that_does_not_wait_never_waits_even_sent_again_at_once(model_sets):
    """A Verify submitted not to wait (a VerifyBatch item) ends with SessionPreemptedError when its session is
    preempted, and so does the same session's next one when it comes back before the step that ended the first is
    over (here from the first's answer, on the loop's thread). It used to wait for the session to resume: one
    core's scheduling made a replica's callers do this on every run, and a batch whose other sessions held the
    blocks that session needed never came back."""
    runner = model_sets("cyclic").runner("target", "fast")
    loop = StepLoop(small_verifier(runner, spare_blocks=1))
    try:
        loop.submit_prefill("a", [3 + i * 7 % 90 for i in range(40)], greedy(MAX_NEW)).result(30)
        loop.submit_prefill("b", [5 + i * 11 % 90 for i in range(24)], greedy(MAX_NEW)).result(30)
        again = []

        def send_again(future):
            if isinstance(future.exception(), SessionPreemptedError):
                again.extend(loop.submit_verifies([("b", TokenTree.empty())], wait_if_preempted=False))

        # a's tree needs more blocks than are free: b, admitted last, is preempted out of this step
        first = loop.submit_verifies([("a", TokenTree.chain(list(range(10, 10 + TREE)))), ("b", TokenTree.empty())],
                                     wait_if_preempted=False)
        first[1].add_done_callback(send_again)
        first[0].result(30)
        assert isinstance(first[1].exception(30), SessionPreemptedError)
        assert loop.stats.preemptions == 1 and len(again) == 1
        assert isinstance(again[0].exception(30), SessionPreemptedError)  # not a result after b resumed
    finally:
        loop.close()

def test_the_context_served_is_what_one_request_can_hold(model_sets):
    runner = model_sets("cyclic").runner("target", "fast")
    local = small_verifier(runner)
    pool_tokens = local.allocator.num_blocks * BLOCK
    assert local.info.max_positions == pool_tokens - 1 - TREE < runner.info.max_positions
    roomy = LocalVerifier(runner, max_tree_nodes=TREE)
    assert roomy.info.max_positions == runner.info.max_positions
    with pytest.raises(ValueError, match="at least|cannot hold one request"):
        LocalVerifier(runner, max_tree_nodes=TREE, block_size=BLOCK, kv_cache_gb=BLOCK * runner.kv_bytes_per_token / 2**30)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "step", "preempt", "release"]), st.integers(0, 5)),
                min_size=1, max_size=40), st.integers(0, 2**16))
def test_the_pool_returns_to_empty_over_any_interleaving(model_sets, ops, seed):
    """Admissions, steps (plain or a random chain), preemptions, resumptions and releases in any order, with
    sessions whose prompts are the same (the prefix cache shares their blocks): the blocks held are exactly those
    in the sessions' tables, a preempted session holds none, and after every session is released the pool is
    empty (cached blocks that no table holds count as free)."""
    runner = model_sets("cyclic").runner("target", "fast")
    local = small_verifier(runner, spare_blocks=6)
    allocator = local.allocator
    rng = random.Random(seed)
    live, preempted = set(), set()
    for op, k in ops:
        sid = f"s{k}"
        if op == "admit" and sid not in live:
            prompt = PROMPTS[k % 3]  # s0 and s3, s1 and s4, s2 and s5 share their prompt
            if local.admission_blocks(len(prompt)) <= allocator.num_free:
                local.admit(sid, prompt, greedy(MAX_NEW))
                live.add(sid)
        elif op == "preempt" and sid in live and sid not in preempted:
            local.preempt(sid)
            preempted.add(sid)
        elif op == "release" and sid in live:
            local.release(sid)
            live.discard(sid)
            preempted.discard(sid)
        elif op == "step":
            for p in sorted(preempted):
                if local.resume_blocks(p) <= allocator.num_free:
                    local.resume(p)
                    preempted.discard(p)
            active = [s for s in sorted(live) if s not in preempted]
            prefills = [s for s in active if local.prefilling(s)]
            verifies = []
            for s in active:
                if s in prefills or local.cache_length(s) + 1 + TREE >= local.info.max_positions - 1:
                    continue
                tree = TokenTree.chain([rng.randrange(3, 100) for _ in range(rng.randrange(0, TREE + 1))])
                verifies.append((s, tree))
            need = sum(local.step_blocks(verifies).values())
            if need <= allocator.num_free and (prefills or verifies):
                _, results = local.step(prefills, verifies)
                assert not any(isinstance(r, Exception) for r in results), results
        held = {b for s in live for b in local._sessions[s].cache.table}
        assert allocator.num_used == len(held)
        assert all(local.held_blocks(s) == 0 for s in preempted)
    for sid in live:
        local.release(sid)
    assert allocator.num_free == allocator.num_blocks


def test_the_pool_on_a_device_takes_what_the_weights_and_a_forward_leave():
    from verifier_service.verifier import device_kv_bytes

    gib = 2**30
    # 80 GiB device, 62 GiB free after the weights and the CUDA context, a forward peaking 2 GiB above that
    assert device_kv_bytes(80 * gib, 62 * gib, 2 * gib, 0.9) == int(0.9 * 80 * gib) - 18 * gib - 2 * gib
    assert device_kv_bytes(80 * gib, 10 * gib, 2 * gib, 0.9) == 0  # others hold the device: nothing left
    with pytest.raises(ValueError, match="kv-cache-memory"):
        device_kv_bytes(80 * gib, 62 * gib, 0, 1.5)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_pool_is_sized_from_the_device():
    import torch
    from service_helpers import TARGET

    from specmesh import models

    runner = models.load_runner(TARGET, torch.float32, "fast", torch.device("cuda"))
    local = LocalVerifier(runner, max_tree_nodes=TREE, kv_cache_memory=0.5)
    free, total = torch.cuda.mem_get_info()
    assert local.allocator.num_blocks * local.allocator.block_size * runner.kv_bytes_per_token <= 0.5 * total
    assert local.info.max_positions == runner.info.max_positions
