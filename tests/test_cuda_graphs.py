"""CUDA graphs of the kernel path's steps (``specmesh/cuda_graphs.py``, ``--cuda-graphs``).

A step is padded to a bucket and run on a pool's static buffers; on CUDA the bucket's graph is captured once and
replayed, on the CPU the same padded step runs eagerly on the same buffers (the kernel under the Triton
interpreter), so what is checked here on every machine is the padding and the buffers: a graphed step gives the
eager step's logits and writes exactly the eager step's slots (padding rows only the pool's scratch block), greedy
decoding through graphs equals plain decoding alone and batched, and the start-up check refuses a replay that
differs from eager.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from unittest.mock import patch

import numpy as np
import pytest
import torch
from spec_helpers import batched_events, engine_for, greedy, tiny_llama
from test_tree_attention import ancestors_of, tree_parents

from specmesh.cuda_graphs import NEW_BUCKETS, ROW_BUCKETS, PoolGraphs, bucket, graph_choice
from specmesh.kernel_attention import kernel_metadata
from specmesh.model_runner import TreeMask

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def pair():
    """A tiny float32 Llama on the kernel path, eager and graphed (one set of weights)."""
    from specmesh.fast_llama import FastLlamaRunner

    model = tiny_llama(seed=11).float().to(DEVICE)
    return (FastLlamaRunner(model, attention="triton", cuda_graphs="off"),
            FastLlamaRunner(model, attention="triton", cuda_graphs="on"))


def test_graph_choice_and_buckets():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_choice("auto", cuda, "triton") == "auto" and graph_choice("auto", cpu, "triton") is None
    assert graph_choice("auto", cuda, "sdpa") is None and graph_choice("off", cuda, "triton") is None
    assert graph_choice("on", cpu, "triton") == "on"  # off CUDA: the static-buffer path, uncaptured
    with pytest.raises(ValueError, match="attention triton"):
        graph_choice("on", cuda, "sdpa")
    with pytest.raises(ValueError, match="cuda-graphs mode"):
        graph_choice("always", cuda, "triton")
    assert [bucket(n, ROW_BUCKETS) for n in (1, 3, 17, 256, 257)] == [1, 4, 24, 256, None]
    assert bucket(65, NEW_BUCKETS) is None


def _fill(pool, value: float) -> None:
    """The same non-zero contents in every slot of a pool (so that slots a step must not write can be compared)."""
    pool.keys.fill_(value)
    pool.values.fill_(-value)


@pytest.mark.parametrize("split", [False, True], ids=["whole-keys", "split-kv"])
def test_graphed_steps_equal_eager_and_write_only_their_slots(pair, monkeypatch, split):
    """Prefill chunks, a tree step and a decode step of four sessions on a fragmented pool, eager and graphed:
    the same logits, and the same pool contents outside the scratch block (which only padding rows write).
    ``split-kv``: the graphed runner splits every launch's keys (as on a GPU with more SMs than programs; here
    with shares of 4 keys), the eager one does not."""
    if split:
        from kernels import tree_attention as ta

        monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 4)
        monkeypatch.setattr(pair[1], "_num_sms", 132)
    rng = random.Random(2)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (37, 5, 1, 20)]
    trees = [tree_parents(shape, n, rng) for shape, n in (("random", 9), ("star", 4), ("chain", 1), ("deep_wide", 12))]
    tokens = [[rng.randrange(128) for _ in t] for t in trees]
    results = []
    for runner in pair:
        pool = runner.new_pool(num_blocks=48, block_size=4)
        runner.pool_graphs(pool)  # the graphed runner's start-up check writes a probe session: before the fill
        _fill(pool, 0.25)
        pool.allocator.allocate(12)  # a used run first, then tables from the shuffled rest
        caches = [pool.open(len(p) + len(t) + 2) for p, t in zip(prompts, trees, strict=True)]
        logits = [runner.forward_batch(caches, np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]),
                                       [len(p) for p in prompts], [None] * len(prompts))]
        masks = [TreeMask(len(p), torch.from_numpy(ancestors_of(t))) for p, t in zip(prompts, trees, strict=True)]
        positions = [len(p) + ancestors_of(t).sum(1) - 1 for p, t in zip(prompts, trees, strict=True)]
        logits.append(runner.forward_batch(caches, np.concatenate(tokens), np.concatenate(positions),
                                           [len(t) for t in trees], masks, logit_rows=torch.tensor([0, 9, 13, 25])))
        for cache, p in zip(caches, prompts, strict=True):
            cache.truncate(len(p))  # the tree rejected: decode one row each after the prompt
        logits.append(runner.forward_batch(caches, [3, 4, 5, 6], [len(p) for p in prompts], [1] * 4, [None] * 4))
        live = slice(0, pool.scratch_slot)
        results.append((logits, pool.keys[:, :, live].clone(), pool.values[:, :, live].clone(),
                        pool.keys[:, :, pool.scratch_slot :].clone()))
    (want, want_k, want_v, untouched), (got, got_k, got_v, scratch) = results
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v, want_v, rtol=1e-4, atol=1e-4)
    assert torch.equal(untouched, torch.full_like(untouched, 0.25))  # eager never writes the scratch block
    assert not torch.equal(scratch, untouched)  # the graphs' padding rows did (63 rows -> 64, 26 -> 32)
    graphs = list(pair[1]._pool_graphs.values())[-1]
    assert graphs.replays == 4  # the start-up check's step and these three
    splits = [key[3] for key in graphs.graphs if key[:3] in {(64, 4, 64), (32, 4, 16)}]  # (decode's: all warm)
    assert len(splits) == 2 and (min(splits) > 1 if split else max(splits) == 1), graphs.graphs


def test_a_session_of_its_own_pool_is_never_graphed(pair):
    """``new_cache``: a session in a pool of its own that grows (reallocated) runs the kernel eagerly on the graphed
    runner, never through graphs (they would keep reading the tensors it had before growing), and gives the eager
    runner's logits while it grows past its first chunk."""
    eager, graphed = pair
    rng = random.Random(7)
    tokens = [rng.randrange(128) for _ in range(262)]  # 12 decode rows: across the first chunk's end
    before, results = graphed.graph_replays, []
    for runner in pair:
        cache = runner.new_cache()
        first_keys = cache.pool.keys
        logits = [runner.forward(cache, tokens[:250], range(250))]
        # decode rows, past the GROW_CHUNK (256) positions it started with: it grows on the way
        logits += [runner.forward(cache, [t], [250 + i]) for i, t in enumerate(tokens[250:])]
        assert cache.pool.keys is not first_keys and not cache.pool.fixed and cache.base == 0
        assert runner.pool_graphs(cache.pool) is None
        results.append(torch.cat(logits))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    assert graphed.graph_replays == before


def test_greedy_through_graphs_equals_plain_decoding(pair):
    """Speculative greedy decoding on the graphed runner, one request and a batch of requests sharing steps,
    equals plain decoding on the eager runner; the graphs served the steps."""
    eager, graphed = pair
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (12, 5, 30)]
    truth = [engine_for(eager).generate(p, greedy(16)).token_ids for p in prompts]
    before = graphed.graph_replays
    assert engine_for(graphed, "prompt_lookup_tree").generate(prompts[0], greedy(16)).token_ids == truth[0]
    events = batched_events(graphed, "prompt_lookup_tree", [(p, greedy(16)) for p in prompts])
    assert [[t for e in evs for t in e.tokens] for evs in events] == truth
    assert graphed.graph_replays > before + 16


def test_the_start_up_check_refuses_a_replay_that_differs(pair, caplog):
    """A replay held to eager with no tolerance fails: ``on`` raises, and a check that may fail turns graphs off."""
    from specmesh.fast_llama import FastLlamaRunner

    eager = pair[0]
    with patch.dict("specmesh.cuda_graphs.CHECK_TOLERANCE", {torch.float32: -1.0}):
        runner = FastLlamaRunner(tiny_llama(seed=11).float().to(DEVICE), attention="triton", cuda_graphs="on")
        with pytest.raises(ValueError, match="differs from the eager"):
            runner.forward(runner.new_pool(num_blocks=16, block_size=4).open(8), [1, 2], [0, 1])
        graphs = PoolGraphs(eager, eager.new_pool(num_blocks=16, block_size=4), capture=False)
        with caplog.at_level(logging.WARNING, logger="specmesh.cuda_graphs"):
            assert not graphs.check()
    assert "CUDA graphs are off" in caplog.text


def test_a_bucket_that_cannot_be_captured_runs_eager(pair, monkeypatch, caplog):
    """A capture that fails mid-serving (a new bucket) leaves that step and the pool's later steps eager under
    ``auto``, with a warning, and the output unchanged; under ``on`` it raises."""
    eager, graphed = pair
    prompt = list(range(5, 25))
    truth = engine_for(eager).generate(prompt, greedy(8)).token_ids
    broken = PoolGraphs(graphed, graphed.new_pool(num_blocks=16, block_size=4), capture=False)

    def fail(key):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(broken, "_record", fail)
    ids, pos = graphed._to_device([1, 2]), graphed._to_device([0, 1])
    meta = kernel_metadata(graphed, [broken.pool.open(4)], [2], [None])
    with caplog.at_level(logging.WARNING, logger="specmesh.cuda_graphs"):
        assert broken.forward(meta, ids, pos, [2]) is None and broken.failed
    assert "run eager" in caplog.text
    broken.required = True
    broken.failed = False
    with pytest.raises(RuntimeError, match="capturing"):
        broken.forward(meta, ids, pos, [2])
    assert engine_for(graphed).generate(prompt, greedy(8)).token_ids == truth  # other pools unaffected


def test_every_plain_decoding_step_finds_its_graph_captured_at_start_up(pair, monkeypatch):
    """A pool's graphs hold every plain-decoding bucket once built (``warm``): the decode steps of any number of
    sessions up to the top rung, with any key share count a GPU's SMs and the sessions' lengths make the runner
    pick (simulated here: 132 SMs, a 4k context), so none pays a capture mid-serving; other buckets wait for use."""
    graphed = pair[1]
    pool = graphed.new_pool(num_blocks=64, block_size=4)
    graphs = graphed.pool_graphs(pool)
    assert set(graphs.decode_keys()) <= set(graphs.graphs)
    assert all(n == 1 for _, _, n, _ in graphs.graphs)  # only decode buckets so far
    cache = pool.open(8)  # a real decode step's bucket is among them
    graphed.forward_eager(cache, [1, 2, 3], [0, 1, 2])
    assert graphs.key(kernel_metadata(graphed, [cache], [1], [None]), [1]) in graphs.graphs
    cache.free()

    monkeypatch.setattr(graphed, "_num_sms", 132)
    monkeypatch.setattr(graphed, "info", dataclasses.replace(graphed.info, max_positions=4096))
    keys = set(PoolGraphs(graphed, pool, capture=False).decode_keys())
    assert max(k for *_, k in keys) > 1  # split-KV buckets are among them
    rng = random.Random(2)
    for _ in range(300):
        sessions, longest = rng.randint(1, 128), rng.randint(1, 4096)
        assert graphs._key(sessions, sessions, 1, longest) in keys, (sessions, longest)
