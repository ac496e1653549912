"""Batched verification across sessions: batched == unbatched == AR, and the paged KV pool.

- ``forward_batch`` over several sessions (prefill chunks, chains, trees; contiguous and
  fragmented block tables) gives the logits and KV entries of one forward per session.
- Engines on many threads sharing one ``StepLoop`` produce the AR greedy output of
  each prompt, for every proposer and both runners, with sessions joining and leaving
  while others run.
- A randomized interleaving of admit / chunked prefill / verify / release over many
  sessions, batched in one LocalVerifier, against one single-session verifier per session.
- Pool invariants: disjoint block tables, contiguity when a run fits, no block leaked after
  release, cancel or failure; a full pool makes a prefill wait (or fail with CapacityError
  when the wait queue is full or it could never fit) and loses no other request.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import engine_for, fragment, greedy, make_prompts, window_for

from drafter_service.proposer import make_proposer, proposer_names, proposer_spec
from specmesh.blocks import BlockAllocator
from specmesh.contract import CapacityError, UnknownSessionError
from specmesh.model_runner import tree_attend_mask
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree, ancestor_mask
from verifier_service.decisions import HostCopy
from verifier_service.step_loop import StepLoop
from verifier_service.verifier import LocalVerifier

PROMPTS = make_prompts(10, seed=7, max_len=40)
MAX_NEW = 20


# ------------------------------------------------------------------ helpers
def random_tree(rng: random.Random, vocab: int, max_nodes: int = 10, truth: list[int] | None = None) -> TokenTree:
    """A random tree; with ``truth`` its first branch follows it for a random length (acceptance happens)."""
    n = rng.randint(0, max_nodes)
    tokens, parents = [], []
    follow = rng.randint(0, min(n, len(truth))) if truth else 0
    for i in range(n):
        if i < follow:
            parents.append(i - 1)
            tokens.append(truth[i])
        else:
            parents.append(rng.randrange(-1, i))
            tokens.append(rng.randrange(vocab))
    return TokenTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.ones(n))


# ----------------------------------------------------------- forward_batch
@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
def test_forward_batch_equals_one_forward_per_session(model_sets, fragmented):
    runner = model_sets("random").runner("target", "fast")
    rng = random.Random(3)
    pool = runner.new_pool(num_blocks=64, block_size=4)
    if fragmented:
        fragment(pool.allocator, rng)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    paged = [pool.open(len(p) + 12) for p in prompts]
    if fragmented:
        assert any(c.base is None for c in paged), "the pool did not fragment"
    single = [runner.new_cache() for _ in prompts]  # each a pool of its own
    # step 1: prompts of different lengths, causal, in one batch
    ids = np.concatenate(prompts)
    pos = np.concatenate([np.arange(len(p)) for p in prompts])
    batched = runner.forward_batch(paged, ids, pos, [len(p) for p in prompts], [None] * len(prompts))
    alone = torch.cat([runner.forward(c, p, range(len(p))) for c, p in zip(single, prompts, strict=True)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-10)
    # step 2: a tree per session (some a chain, one empty tree: just the pending token)
    trees = [random_tree(rng, 128, max_nodes=8) for _ in prompts]
    trees[0] = TokenTree.empty()
    rows = [np.concatenate([[7], t.tokens]) for t in trees]
    positions = [np.concatenate([[len(p)], len(p) + 1 + t.depth]) for p, t in zip(prompts, trees, strict=True)]
    attends = [tree_attend_mask(len(p), torch.from_numpy(ancestor_mask(np.concatenate([[-1], t.parents + 1]))))
               for p, t in zip(prompts, trees, strict=True)]
    batched = runner.forward_batch(paged, np.concatenate(rows), np.concatenate(positions),
                                   [len(r) for r in rows], attends, torch.tensor([0, 3, len(np.concatenate(rows)) - 1]))
    alone = torch.cat([runner.forward(c, r, q, a) for c, r, q, a in zip(single, rows, positions, attends, strict=True)])
    torch.testing.assert_close(batched, alone[[0, 3, -1]], rtol=0, atol=1e-10)
    # compaction keeps the same entries in both layouts
    for cache, ref, tree, prompt in zip(paged, single, trees, prompts, strict=True):
        keep = [0] + [1 + n for n in tree.path_to(tree.num_nodes - 1)] if tree.num_nodes else [0]
        cache.keep(len(prompt), keep)
        ref.keep(len(prompt), keep)
        for layer in range(len(runner.layers)):
            for got, want in zip(cache.layer_kv(layer), ref.layer_kv(layer), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------- engines on many threads
def _concurrent_outputs(runner, proposer, prompts, draft_runner=None, **verifier_opts):
    topk = 8 if proposer is not None and "recycling" in proposer or proposer == "fused" else 0
    window = window_for(make_proposer(proposer)) if proposer == "lookahead" else None
    batching = StepLoop(LocalVerifier(runner, feedback_topk=topk, lookahead=window, **verifier_opts))
    outputs: list = [None] * len(prompts)
    rng = random.Random(0)
    delays = [rng.random() * 0.05 for _ in prompts]  # staggered: sessions join while others run

    def work(i):
        time.sleep(delays[i])
        engine = engine_for(runner, proposer, draft_runner=draft_runner, verifier=batching)
        outputs[i] = engine.generate(prompts[i], greedy(MAX_NEW)).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert batching.stats.max_batch > 1, "no two sessions were ever verified in one forward"
        assert batching.verifier.allocator.num_free == batching.verifier.allocator.num_blocks, "KV blocks leaked"
        assert batching.num_sessions == 0
    finally:
        batching.close()
    return outputs


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("proposer", [None, *proposer_names()])
def test_concurrent_sessions_equal_ar(model_sets, ar_reference, proposer, backend):
    kind = "random" if proposer and proposer_spec(proposer).needs_draft_model else "cyclic"
    ms = model_sets(kind)
    runner = ms.runner("target", backend)
    outputs = _concurrent_outputs(runner, proposer, PROMPTS, draft_runner=ms.runner("near", backend))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out == ar_reference(kind, backend, prompt, MAX_NEW)


def test_chunked_prefill_beside_decoding_equals_ar(model_sets, ar_reference):
    """Prompts far longer than the prefill chunk are prefilled over several steps while others decode."""
    runner = model_sets("cyclic").runner("target", "fast")
    prompts = make_prompts(6, seed=11, min_len=60, max_len=200)
    outputs = _concurrent_outputs(runner, "prompt_lookup", prompts, prefill_chunk=16)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == ar_reference("cyclic", "fast", prompt, MAX_NEW)


# -------------------------------------------------- randomized interleaving
@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_interleaving_matches_single_session_reference(model_sets, ar_reference, backend, seed):
    rng = random.Random(seed)
    runner = model_sets("cyclic").runner("target", backend)
    batched = LocalVerifier(runner, max_tree_nodes=16, kv_cache_gb=2e-3, block_size=8, prefill_chunk=9)
    fragment(batched.allocator, rng)
    free_at_start = batched.allocator.num_free
    refs: dict[str, LocalVerifier] = {}
    truth: dict[str, list[int]] = {}  # the AR continuation, so that trees get accepted
    committed: dict[str, int] = {}
    next_id = 0
    for _ in range(60):
        live = [s for s in refs if not batched.prefilling(s)]
        prefilling = [s for s in refs if batched.prefilling(s)]
        if len(refs) < 6 and rng.random() < 0.4:
            sid = f"s{next_id}"
            next_id += 1
            prompt = PROMPTS[rng.randrange(len(PROMPTS))]
            sampling = greedy(MAX_NEW)
            batched.admit(sid, prompt, sampling)
            refs[sid] = LocalVerifier(runner, max_tree_nodes=16)
            first = refs[sid].prefill(sid, prompt, sampling).first_token
            truth[sid] = [first, *ar_reference("cyclic", backend, prompt, MAX_NEW)[1:]]
            committed[sid] = 1
            prefilling.append(sid)
        for sid in [s for s in live if rng.random() < 0.15]:  # done or cancelled
            batched.release(sid)
            refs.pop(sid).release(sid)
            live.remove(sid)
        picks = [s for s in live if rng.random() < 0.7 and committed[s] + 17 < MAX_NEW]
        trees = [(s, random_tree(rng, 128, max_nodes=10, truth=truth[s][committed[s]:])) for s in picks]
        firsts, results = batched.step(prefilling, trees)
        for sid, first in firsts.items():
            assert first == truth[sid][0]
        for (sid, tree), result in zip(trees, results, strict=True):
            want = refs[sid].verify(sid, tree)
            assert not isinstance(result, Exception), result
            assert (result.accepted_nodes, result.tokens) == (want.accepted_nodes, want.tokens)
            assert list(result.tokens) == truth[sid][committed[sid] : committed[sid] + len(result.tokens)]
            committed[sid] += len(result.tokens)
            assert batched.cache_length(sid) == refs[sid].cache_length(sid)
    for sid in list(refs):
        batched.release(sid)
    assert batched.allocator.num_free == free_at_start


def test_step_isolates_a_bad_request(model_sets):
    """An invalid tree or an unknown session fails alone; the rest of the step runs."""
    runner = model_sets("cyclic").runner("target", "fast")
    verifier = LocalVerifier(runner, max_tree_nodes=4)
    for sid in ("a", "b"):
        verifier.prefill(sid, PROMPTS[0], greedy(MAX_NEW))
    big = TokenTree.chain(list(range(10)))
    _, results = verifier.step((), [("a", big), ("nobody", TokenTree.empty()), ("b", TokenTree.empty())])
    assert isinstance(results[0], ValueError) and isinstance(results[1], UnknownSessionError)
    assert len(results[2].tokens) == 1
    assert verifier.cache_length("a") == len(PROMPTS[0])  # untouched by its failed step


def test_a_step_is_launched_then_finished(model_sets, monkeypatch):
    """``launch`` does a step's host work up to its one copy (the forward, staged decisions, the copy started) and
    ``finish`` waits for the copy and accepts: the caller's work between them (PEARL's drafting ahead) runs while
    a GPU works, with nothing of the step's left on the host. A step whose every verify failed launches no
    forward and no copy; ``step`` is the two in one."""
    runner = model_sets("cyclic").runner("target", "fast")
    verifier = LocalVerifier(runner, max_tree_nodes=4)
    reference = LocalVerifier(runner, max_tree_nodes=4)
    reference.prefill("a", PROMPTS[0], greedy(MAX_NEW))
    events: list[str] = []
    forward = runner.forward_batch
    monkeypatch.setattr(runner, "forward_batch", lambda *a, **k: (events.append("forward"), forward(*a, **k))[1])
    for name in ("start", "wait"):
        real = getattr(HostCopy, name)
        monkeypatch.setattr(HostCopy, name, lambda self, real=real, name=name: (events.append(name), real(self))[1])
    verifier.admit("a", PROMPTS[0], greedy(MAX_NEW))
    in_flight = verifier.launch(["a"], ())  # the prompt: one chunk
    assert events == ["forward", "start"]
    events.append("meanwhile")
    firsts, _ = verifier.finish(in_flight)
    assert "a" in firsts and events == ["forward", "start", "meanwhile", "wait"]
    for tree in (TokenTree.empty(), TokenTree.chain([1, 2, 3])):
        events.clear()
        in_flight = verifier.launch((), [("a", tree)])
        events.append("meanwhile")
        _, results = verifier.finish(in_flight)
        assert events == ["forward", "start", "meanwhile", "wait"]
        assert results[0].tokens == reference.verify("a", tree).tokens
    events.clear()
    _, results = verifier.finish(verifier.launch((), [("nobody", TokenTree.empty())]))
    assert isinstance(results[0], UnknownSessionError) and events == []


# ----------------------------------------------------------------- pool
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=40), st.integers(1, 8))
def test_allocator_tables_are_disjoint_and_contiguous_when_possible(ops, block_size):
    allocator = BlockAllocator(24, block_size)
    tables: list[list[int]] = []
    for alloc, tokens in ops:
        if alloc or not tables:
            need = allocator.blocks_for(tokens)
            runs = allocator._runs()
            try:
                table = allocator.allocate(tokens)
            except CapacityError:
                assert need > sum(length for _, length in runs)
                continue
            assert len(table) == need
            if any(length >= need for _, length in runs):
                assert table == list(range(table[0], table[0] + need))
            tables.append(table)
        else:
            allocator.free(tables.pop(tokens % len(tables)))
        used = [b for t in tables for b in t]
        assert len(used) == len(set(used)) == allocator.num_used
    if tables:  # a double free is a bug, never silently accepted
        allocator.free(tables[0])
        with pytest.raises(RuntimeError, match="already free"):
            allocator.free(tables[0])


def _sampling(max_new: int = MAX_NEW) -> SamplingParams:
    return greedy(max_new)


def test_full_pool_waits_then_admits_and_loses_nothing(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    # admission takes a prompt's blocks: two of these fit, a third waits (distinct: nothing in the prefix cache)
    prompt = {sid: (PROMPTS[i] * 20)[:80] for i, sid in enumerate("abcdf")}
    per_session = len(prompt["a"]) + MAX_NEW + 1 + 8  # a session's largest footprint (max_tree_nodes=8)
    local = LocalVerifier(runner, max_tree_nodes=8, kv_cache_gb=2 * per_session * runner.kv_bytes_per_token / 2**30,
                          block_size=1)
    batching = StepLoop(local, max_waiting=1)
    try:
        batching.prefill("a", prompt["a"], _sampling())
        batching.prefill("b", prompt["b"], _sampling())
        waiting = batching.submit_prefill("c", prompt["c"], _sampling())  # no blocks: waits
        time.sleep(0.2)
        assert not waiting.done() and batching.num_waiting == 1
        with pytest.raises(CapacityError, match="already wait"):  # the wait queue (1) is full
            batching.prefill("d", prompt["d"], _sampling())
        with pytest.raises(ValueError, match="raise --kv-cache-gb"):  # past what the pool can ever hold for one
            batching.prefill("e", list(range(3)) * per_session, _sampling())
        # the running sessions are unaffected: finish "a" by plain decoding
        tokens = []
        for _ in range(MAX_NEW - 1):
            tokens += batching.verify("a", TokenTree.empty()).tokens
        assert tokens == ar_reference("cyclic", "fast", prompt["a"], MAX_NEW)[1:]
        batching.release("a")
        first = waiting.result(timeout=10)  # admitted once "a" gave its blocks back
        assert first.first_token == ar_reference("cyclic", "fast", prompt["c"], MAX_NEW)[0]
        # a waiting request that is released (its caller went away) takes nothing
        later = batching.submit_prefill("f", prompt["f"], _sampling())
        batching.release("f")
        with pytest.raises(RuntimeError, match="released"):
            later.result(timeout=10)
        for sid in ("b", "c"):
            batching.release(sid)
        assert local.allocator.num_free == local.allocator.num_blocks and batching.num_sessions == 0
    finally:
        batching.close()


def test_released_mid_prefill_returns_its_blocks(model_sets):
    runner = model_sets("cyclic").runner("target", "fast")
    local = LocalVerifier(runner, prefill_chunk=4)
    local.admit("x", PROMPTS[2], _sampling())
    local.step(["x"], ())
    assert local.prefilling("x") and local.allocator.num_used > 0
    local.release("x")
    assert local.allocator.num_used == 0


def test_cancelled_calls_are_skipped_and_the_scheduler_lives_on(model_sets, ar_reference):
    """A caller that goes away (gRPC cancel/deadline cancels its future) never breaks the scheduler."""
    runner = model_sets("cyclic").runner("target", "fast")
    batching = StepLoop(LocalVerifier(runner))
    try:
        batching.prefill("a", PROMPTS[0], _sampling())
        for _ in range(20):  # cancel at random points of the scheduler's cycle
            batching.submit_verify("a", TokenTree.empty()).cancel()
            time.sleep(0.001)
        batching.submit_prefill("gone", PROMPTS[1], _sampling()).cancel()
        batching.release("gone")
        got = batching.verify("a", TokenTree.empty()).tokens  # still served
        assert len(got) == 1
        batching.release("a")
        assert batching.verifier.allocator.num_used == 0 and batching.num_sessions == 0
    finally:
        batching.close()


# ------------------------------------------------------------- sampling
def test_a_seeded_request_samples_the_same_alone_or_batched(model_sets):
    """A request's random draws come from its own generator: batching it with other sessions (of other seeds,
    trees and lengths) changes nothing in its output."""
    runner = model_sets("cyclic").runner("target", "fast")
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=5, max_new_tokens=MAX_NEW, ignore_eos=True)
    alone = engine_for(runner, "prompt_lookup").generate(PROMPTS[1], sampling).token_ids
    batching = StepLoop(LocalVerifier(runner))
    outputs: dict[int, list[int]] = {}

    def work(i):
        sp = sampling if i == 0 else SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=MAX_NEW)
        outputs[i] = engine_for(runner, "prompt_lookup", verifier=batching).generate(PROMPTS[1 + i], sp).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert batching.stats.max_batch > 1
    finally:
        batching.close()
    assert outputs[0] == alone


# --------------------------------------------------------------- service
def test_verifier_service_exhaustion_and_block_return(demo_stack):
    """Over gRPC: a Prefill whose prompt the pool cannot hold now is RESOURCE_EXHAUSTED (the queue is off), the
    running session is unaffected, and released or reaped sessions give their KV blocks back (Info)."""
    import grpc
    import service_helpers as sh

    from specmesh import rpc
    from verifier_service.remote import VerifierClient

    prompt = demo_stack.tokenizer.encode("def add(a, b):\n    return a + b\n" * 6)
    sampling = greedy(16)
    per_session = len(prompt) + 16 + 1 + 8  # a session's largest footprint with --max-tree-nodes 8
    gb = per_session * demo_stack.target_runner.kv_bytes_per_token / 2**30
    service = sh.verifier("--kv-cache-gb", repr(gb * 1.5), "--block-size", "1", "--max-tree-nodes", "8",
                          "--max-waiting", "0", "--session-ttl", "2", "--no-cost-profile")
    try:
        service.wait_ready()
        client = VerifierClient(service.address, rpc.Security(), call_timeout=30)
        info = client.fetch_info(timeout=30)
        total = info.kv_blocks_total
        assert info.kv_block_size == 1 and per_session <= total < 2 * per_session
        remote = client.bind(None)
        first = remote.prefill("a", prompt, sampling).first_token
        assert client.fetch_info(timeout=10).kv_blocks_free == total - len(prompt)  # admission takes the prompt's
        with pytest.raises(rpc.UpstreamError) as err:
            remote.prefill("b", prompt, sampling)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        local = LocalVerifier(demo_stack.target_runner, max_tree_nodes=8)
        assert local.prefill("a", prompt, sampling).first_token == first
        for _ in range(3):  # the running session is served as before
            assert remote.verify("a", TokenTree.empty()).tokens == local.verify("a", TokenTree.empty()).tokens
        remote.release("a")
        assert client.fetch_info(timeout=10).kv_blocks_free == total
        remote.prefill("b", prompt, sampling)  # fits now; never released: the idle reaper frees it
        assert sh.wait_until(lambda: client.fetch_info(timeout=10).kv_blocks_free == total, timeout=20)
        client.close()
    finally:
        service.stop()
