"""One device-to-host transfer per verifier step and per batched draft step (issue 32 items 1-2).

Every decision a step makes (greedy and sampled acceptance of chains and trees, MJSD, the top-k feedback, the
lookahead window's outputs, log-probabilities, a finishing prefill's first token) is staged on the device and copied
to the host once. On the CPU there is no device, so the test marks what the forward returns
(``specmesh.host_reads``): its outputs are ``OnDevice`` tensors, whose subclass every result computed from them
keeps, and every read of one on the host (``.cpu()``, ``.tolist()``, ``.item()``, ``.numpy()``,
``bool()``/``int()``/``float()``, ``np.asarray``) or operation that makes a device wait for its host (``nonzero``,
``unique``, boolean-mask indexing) is counted. On CUDA a step's decisions
are staged under ``torch.cuda.set_sync_debug_mode`` (the forward's own metadata copies are issue 32 item 3's).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from specmesh import warp
from specmesh.fast_llama import FastLlamaRunner
from specmesh.host_reads import counting, mark_outputs
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.decisions import Decisions, HostCopy, Item
from verifier_service.lookahead import LookaheadConfig
from verifier_service.verifier import LocalVerifier


@pytest.fixture(autouse=True)
def device_paths(monkeypatch):
    """The accelerator's code paths: top-p by a full sort (the CPU's shortcut reads the host; see specmesh.warp)."""
    monkeypatch.setattr(warp, "CPU_SHORTCUT", False)


def marked(model_sets):
    """A runner of the random target of its own, its forward's outputs (logits, features) marked ``OnDevice``."""
    return mark_outputs(FastLlamaRunner(model_sets("random").target))


def tree_for(rng: random.Random, kind: str, vocab: int) -> TokenTree:
    """chain: 4 tokens; tree: two branches (4 and 2 tokens) and a second child of the first node; empty."""
    if kind == "empty":
        return TokenTree.empty()
    if kind == "chain":
        return TokenTree.chain([rng.randrange(vocab) for _ in range(4)])
    tokens = [rng.randrange(vocab) for _ in range(7)]
    return TokenTree(np.array(tokens, np.int64), np.array([-1, 0, 1, 2, -1, 4, 0], np.int64), np.ones(7))


SESSIONS = {
    "greedy": SamplingParams(max_new_tokens=64),
    "greedy_logprobs": SamplingParams(max_new_tokens=64, logprobs=3),
    "sampled": SamplingParams(max_new_tokens=64, temperature=0.8, top_p=0.9),
    "sampled_seeded_logprobs": SamplingParams(max_new_tokens=64, temperature=0.7, top_k=20, seed=5, logprobs=2),
    "penalised": SamplingParams(max_new_tokens=64, temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2),
    "mjsd": SamplingParams(max_new_tokens=64, acceptance="mjsd", mjsd_threshold=0.3),
}


@pytest.mark.parametrize("kinds", [("empty",), ("chain",), ("tree",), ("empty", "chain", "tree")],
                         ids=["plain", "chains", "trees", "mixed"])
@pytest.mark.parametrize("modes", [("greedy",), ("sampled",), tuple(SESSIONS)], ids=["greedy", "sampled", "all"])
@pytest.mark.parametrize("extras", ["none", "feedback_lookahead"])
def test_a_step_reads_the_device_once(model_sets, kinds, modes, extras):
    runner = marked(model_sets)
    vocab = runner.info.vocab_size
    options = {"feedback_topk": 4, "lookahead": LookaheadConfig(window=3, ngram=3)} if extras != "none" else {}
    verifier = LocalVerifier(runner, prefill_chunk=16, **options)
    rng = random.Random(hash((kinds, modes, extras)) % 2**32)
    ids = [f"{mode}-{i}" for i, mode in enumerate(modes * 2)]
    for sid in ids:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 30))]
        verifier.admit(sid, prompt, SESSIONS[sid.split("-")[0]])
    steps = 0
    while prefilling := [sid for sid in ids if verifier.prefilling(sid)]:
        with counting() as reads:
            verifier.step(prefilling, ())
        assert len(reads) == 1, reads
        steps += 1
    for step in range(6):
        trees = [(sid, tree_for(rng, kinds[(i + step) % len(kinds)], vocab)) for i, sid in enumerate(ids)]
        with counting() as reads:
            _, results = verifier.step((), trees)
        assert len(reads) == 1, reads  # HostCopy.fetch, and nothing else
        for sid, result in zip(ids, results, strict=True):
            assert not isinstance(result, Exception), result
            assert result.tokens, result
            if SESSIONS[sid.split("-")[0]].logprobs is not None:
                assert len(result.logprobs) == len(result.tokens)
        steps += 1
    assert steps >= 7


def test_a_mixed_step_with_prefills_and_verifies_reads_once(model_sets):
    runner = marked(model_sets)
    verifier = LocalVerifier(runner, prefill_chunk=8)
    rng = random.Random(1)
    verifier.admit("a", [rng.randrange(100) for _ in range(5)], SESSIONS["sampled"])
    verifier.step(["a"], ())
    verifier.admit("b", [rng.randrange(100) for _ in range(20)], SESSIONS["sampled_seeded_logprobs"])
    for step in range(3):  # b's 20-token prompt in chunks of 8, beside a's trees; its first token at the last
        with counting() as reads:
            firsts, results = verifier.step(["b"], [("a", TokenTree.chain([1, 2, 3][: step + 1]))])
        assert len(reads) == 1, reads
        assert results[0].tokens and ("b" in firsts) == (step == 2)
    assert len(verifier.take_first_logprobs("b")) == 1


def test_a_batched_draft_step_reads_the_device_once(model_sets, monkeypatch):
    """Item 2: a draft model's chains for many sessions, greedy and sampled (catch-up forward, one forward per
    level, argmax, draws from q and stop rules on the device) copy the finished chains and their q to the host
    once."""
    from drafter_service import draft_model
    from drafter_service.draft_model import DraftModelProposer
    from drafter_service.proposer import DraftSessionState
    from specmesh.contract import Budget

    monkeypatch.setattr(draft_model, "CPU_STOPS_EARLY", False)
    proposer = DraftModelProposer(marked(model_sets), min_confidence=0.1)
    rng = random.Random(2)
    samplings = [SamplingParams(max_new_tokens=32), SESSIONS["sampled"], SESSIONS["sampled_seeded_logprobs"],
                 SamplingParams(max_new_tokens=32, temperature=1.0)]
    states = [DraftSessionState(f"s{i}", [rng.randrange(100) for _ in range(rng.randint(2, 20))], sampling)
              for i, sampling in enumerate(samplings)]
    budgets = [Budget(6, 6), Budget(3, 3), Budget(8, 4, min_path_prob=0.01), Budget(1, 1)]
    for _ in range(3):
        with counting() as reads:
            trees = proposer.propose_batch(states, budgets)
        assert len(reads) == 1, reads
        assert all(0 < tree.num_nodes <= min(b.max_nodes, b.max_depth) for tree, b in zip(trees, budgets, strict=True))
        assert [tree.has_draft_dists for tree in trees] == [False, True, True, True]
        for state, tree in zip(states, trees, strict=True):
            state.tokens += tree.tokens[:1].tolist() + [rng.randrange(100)]


def test_the_counter_sees_a_host_read(model_sets):
    """The instrument itself: an argmax copied outside the one transfer is seen."""
    runner = marked(model_sets)
    out = runner.forward_batch([runner.new_pool(8, 4).open(4)], np.arange(3), np.arange(3), [3], [None])
    with counting() as reads:
        out.argmax(dim=-1).cpu()
        out.argmax(dim=-1).tolist()
        out[out > 0]
        (out * 2).sum().item()
    assert reads == ["cpu", "tolist", "__getitem__", "item"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decisions_wait_for_the_device_once():
    """On CUDA: staging a step's decisions (greedy chain, sampled trees seeded and not, MJSD, logprobs, top-k) makes
    the host wait nowhere (the sync debug mode warns at each synchronising call) but at the one copy."""
    rng = random.Random(0)
    vocab = 1000
    items, first = [], 0
    for name, kind in (("greedy", "chain"), ("sampled", "tree"), ("sampled_seeded_logprobs", "tree"),
                       ("greedy_logprobs", "tree"), ("mjsd", "chain"), ("sampled", "empty")):
        tree = tree_for(rng, kind, vocab)
        sampling = SESSIONS[name]
        gen = torch.Generator("cuda").manual_seed(sampling.seed) if sampling.seed is not None else None
        items.append(Item(sampling, gen, tree, first))
        first += tree.num_nodes + 1
    logits = torch.randn(first, vocab, device="cuda")
    shared = torch.Generator("cuda").manual_seed(1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            copy = HostCopy()
            argmax = logits.argmax(dim=-1)
            handle = copy.add(argmax)
            copy.add(torch.topk(logits, 4, dim=-1).indices)
            decisions = Decisions(items, logits, argmax, copy, shared)
            copy.fetch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]  # not the mode's notice
    assert len(syncs) <= 1, syncs
    acceptances, logprobs = decisions.resolve(copy[handle].astype(np.int64))
    assert len(acceptances) == len(items) and logprobs[2] is not None and logprobs[0] is None
