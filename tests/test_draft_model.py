"""The draft-model proposer against brute force on the same draft model (no cache, no masks).

A wrong draft forward (bad tree mask, positions, stale cache) never changes greedy output;
it only lowers acceptance, and under sampling a wrong shipped q breaks losslessness. So the
proposals themselves are checked: chain tokens / q against a full recompute of the draft
model, the dynamic tree against a plain re-implementation of its selection rule, and
proposals after cache reuse against proposals from a fresh cache.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from spec_helpers import BACKENDS, make_prompts

from drafter_service.draft_model import DraftModelProposer
from drafter_service.proposer import DraftSessionState
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams
from specmesh.warp import warp_probs

PROMPTS = make_prompts(6, seed=17)


@torch.no_grad()
def full_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1].double()


GREEDY = SamplingParams()


def _state(tokens, sampling=GREEDY, seed=0):
    return DraftSessionState("s", list(tokens), dataclasses.replace(sampling, seed=seed))


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_chain_is_the_draft_models_greedy_continuation(model_sets, backend):
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", backend), tree=False)
    for prompt in PROMPTS:
        tree = prop.propose(_state(prompt), Budget(6, 5))
        assert tree.num_nodes == 5 and tree.parents.tolist() == [-1, 0, 1, 2, 3]
        seq = list(prompt)
        for i in range(5):
            probs = torch.softmax(full_logits(ms.near, seq), -1)
            assert int(tree.tokens[i]) == int(probs.argmax())
            assert tree.draft_probs[i] == pytest.approx(float(probs.max()), rel=1e-5)
            seq.append(int(tree.tokens[i]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("warp", [(1.0, 0, 1.0), (0.7, 10, 0.9)])
def test_sampled_chain_ships_the_exact_warped_draft_distribution(model_sets, backend, warp):
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", backend), tree=False)
    temperature, top_k, top_p = warp
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for j, prompt in enumerate(PROMPTS):
        tree = prop.propose(_state(prompt, sp, seed=j), Budget(4, 4))
        tree.validate(ms.near.config.vocab_size)
        assert tree.has_draft_dists and tree.num_nodes == 4
        seq = list(prompt)
        for i in range(4):
            q = warp_probs(full_logits(ms.near, seq), temperature, top_k, top_p)
            ids, vals = tree.draft_dist(i)
            assert sorted(ids.tolist()) == torch.nonzero(q).flatten().tolist()
            np.testing.assert_allclose(vals, q[torch.as_tensor(ids)].numpy(), rtol=1e-5, atol=1e-9)
            tok = int(tree.tokens[i])
            assert q[tok] > 0 and tree.draft_probs[i] == pytest.approx(float(q[tok]), rel=1e-5)
            seq.append(tok)


def ref_dynamic_tree(model, tokens, budget: Budget, branching: int, expand_width: int, log_q):
    """EAGLE-2 selection, as DraftModelProposer documents it, with a full forward per expanded node."""
    cand: list[dict] = []

    def children(parent: int, lq: torch.Tensor, score: float, depth: int) -> list[int]:
        top = torch.topk(lq, min(branching, budget.max_nodes))
        out = []
        for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if v == float("-inf"):
                break
            cand.append({"tok": t, "parent": parent, "depth": depth, "score": score + v, "lq": v})
            out.append(len(cand) - 1)
        return out

    def path(c: int) -> list[int]:
        out = []
        while c >= 0:
            out.append(cand[c]["tok"])
            c = cand[c]["parent"]
        return out[::-1]

    frontier = children(-1, log_q(full_logits(model, tokens)), 0.0, 0)
    for depth in range(1, budget.max_depth):
        expand = sorted(frontier, key=lambda c: -cand[c]["score"])[:expand_width]
        frontier = []
        for c in expand:
            frontier += children(c, log_q(full_logits(model, tokens + path(c))), cand[c]["score"], depth)
    order = sorted(range(len(cand)), key=lambda c: (-cand[c]["score"], cand[c]["depth"], c))
    chosen = sorted(order[: budget.max_nodes], key=lambda c: (cand[c]["depth"], c))
    index = {c: i for i, c in enumerate(chosen)}
    return (
        [cand[c]["tok"] for c in chosen],
        [index[cand[c]["parent"]] if cand[c]["parent"] >= 0 else -1 for c in chosen],
        [math.exp(cand[c]["lq"]) for c in chosen],
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [(4, 3), (10, 4), (20, 6)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_dynamic_tree_matches_brute_force_selection(model_sets, backend, budget):
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", backend), tree=True, branching=3, expand_width=2)
    b = Budget(*budget)
    for prompt in PROMPTS[:4]:
        state = _state(prompt)
        tree = prop.propose(state, b)
        tree.validate(ms.near.config.vocab_size, max_nodes=b.max_nodes, max_depth=b.max_depth)
        toks, parents, probs = ref_dynamic_tree(ms.near, list(prompt), b, 3, 2, lambda x: torch.log_softmax(x, -1))
        assert tree.tokens.tolist() == toks
        assert tree.parents.tolist() == parents
        np.testing.assert_allclose(tree.draft_probs, probs, rtol=1e-5)
        # the draft cache is back to the committed tokens only
        dc = state.scratch[prop.name]
        assert dc.cached == list(prompt) and dc.cache.length == len(prompt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_proposals_after_cache_reuse_equal_proposals_from_scratch(model_sets, backend, tree):
    """Commit some drafted tokens (a partial acceptance) plus a bonus, propose again: the reused
    draft cache must give what a fresh proposer gives for the same committed tokens."""
    ms = model_sets("random")
    runner = ms.runner("near", backend)
    prop = DraftModelProposer(runner, tree=tree, branching=3, expand_width=2)
    rng = random.Random(4)
    budget = Budget(8, 4)
    for prompt in PROMPTS[:4]:
        state = _state(prompt)
        for _ in range(6):
            proposal = prop.propose(state, budget)
            path = proposal.path_to(rng.randrange(proposal.num_nodes))
            keep = rng.randint(0, len(path))
            state.tokens += [int(proposal.tokens[i]) for i in path[:keep]] + [rng.randrange(128)]
            fresh = DraftModelProposer(runner, tree=tree, branching=3, expand_width=2).propose(_state(state.tokens), budget)
            again = prop.propose(state, budget)
            assert again.tokens.tolist() == fresh.tokens.tolist()
            assert again.parents.tolist() == fresh.parents.tolist()
            np.testing.assert_allclose(again.draft_probs, fresh.draft_probs, rtol=1e-5)


def test_empty_budget_or_context_full_gives_empty_tree(model_sets):
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", "hf"))
    assert prop.propose(_state([1, 2, 3]), Budget(0, 4)).num_nodes == 0
    assert prop.propose(_state([1, 2, 3]), Budget(4, 0)).num_nodes == 0
    assert prop.propose(_state([1] * 510), Budget(4, 4)).num_nodes == 0  # 510 + 4 > 512 positions


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.9])
def test_confidence_stop_ends_the_chain_after_the_first_doubtful_token(model_sets, threshold):
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", "fast"), tree=False, min_confidence=threshold)
    for prompt in PROMPTS:
        tree = prop.propose(_state(prompt), Budget(6, 6))
        probs = tree.draft_probs.tolist()
        # every token but the last is confident; the chain stops at the first doubtful one or at the budget
        assert all(p >= threshold for p in probs[:-1])
        assert probs[-1] < threshold or tree.num_nodes == 6


def test_confidence_stop_keeps_greedy_output_equal_to_ar(model_sets):
    from spec_helpers import engine_for, greedy

    ms = model_sets("random")
    target = ms.runner("target", "fast")
    ar = engine_for(target)
    spec = engine_for(target, "draft_model", 6, 6, draft_runner=ms.runner("near", "fast"), min_confidence=0.3)
    for prompt in PROMPTS:
        assert spec.generate(prompt, greedy(24)).token_ids == ar.generate(prompt, greedy(24)).token_ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("sampled", "tree"), [(False, False), (True, False), (False, True), (True, True)],
                         ids=["chain", "chain-sampled", "tree", "tree-sampled"])
def test_batched_drafts_equal_one_session_at_a_time(model_sets, backend, sampled, tree):
    """``propose_batch`` (one draft forward per level for every session, caches caught up in one forward) drafts
    the chains and dynamic trees ``propose`` drafts session by session, including sampled tokens and their
    shipped q, over rounds of context edits (accepted drafts kept in the cache, rejected ones rolled back)."""
    batched_equals_alone(model_sets("random").runner("near", backend), sampled, tree)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("min_confidence", [0.0, 0.2])
def test_device_chains_run_every_level_and_draft_the_same(model_sets, monkeypatch, min_confidence, sampled):
    """Chains on an accelerator (``_device_chains`` without the CPU's early stop: every level to the longest
    budget, chains that stopped fed on unseen) ship the chains and q ``propose`` drafts one by one (a sampled
    chain's draws are taken at its start, whatever its length), and their draft caches stay right for the next
    round."""
    from drafter_service import draft_model

    monkeypatch.setattr(draft_model, "CPU_STOPS_EARLY", False)
    batched_equals_alone(model_sets("random").runner("near", "fast"), sampled, False, min_confidence)


def test_a_wide_draft_distribution_ships_its_truncated_support_exactly(model_sets, monkeypatch):
    """A sampled token is drawn from q's DRAFT_SUPPORT most likely tokens, renormalised, and exactly that q ships
    (so rejection sampling stays lossless): at temperature 3 on the 128-token model, a support of 16."""
    from drafter_service import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_SUPPORT", 16)
    ms = model_sets("random")
    prop = DraftModelProposer(ms.runner("near", "fast"), tree=False)
    prompt = PROMPTS[0]
    tree = prop.propose(_state(prompt, SamplingParams(temperature=3.0), seed=1), Budget(3, 3))
    q = warp_probs(full_logits(ms.near, list(prompt)), 3.0)
    ids, vals = tree.draft_dist(0)
    top = torch.topk(q, 16)
    assert sorted(ids.tolist()) == sorted(top.indices.tolist())
    np.testing.assert_allclose(vals, (q[torch.as_tensor(ids)] / top.values.sum()).numpy(), rtol=1e-5)  # runners: fp32
    assert int(tree.tokens[0]) in ids.tolist() and vals.sum() == pytest.approx(1.0)


def batched_equals_alone(runner, sampled: bool, tree: bool, min_confidence: float = 0.0) -> None:
    prompts = make_prompts(5, seed=23, min_len=3, max_len=30)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=64) if sampled else GREEDY
    budgets = [Budget(6, 6), Budget(3, 2), Budget(0, 0), Budget(8, 4, min_path_prob=0.05), Budget(1, 1)]
    if tree:
        budgets[0] = Budget(12, 4)
    one = DraftModelProposer(runner, tree=tree, min_confidence=min_confidence)
    batched = DraftModelProposer(runner, tree=tree, min_confidence=min_confidence)
    alone = [_state(list(p), sampling, seed=i) for i, p in enumerate(prompts)]
    together = [_state(list(p), sampling, seed=i) for i, p in enumerate(prompts)]
    rng = random.Random(0)
    for _ in range(3):
        want = [one.propose(s, b) for s, b in zip(alone, budgets, strict=True)]
        got = batched.propose_batch(together, budgets)
        for w, g in zip(want, got, strict=True):
            assert g.tokens.tolist() == w.tokens.tolist() and g.parents.tolist() == w.parents.tolist()
            np.testing.assert_allclose(g.draft_probs, w.draft_probs, rtol=1e-9)
            assert (g.q_cu is None) == (w.q_cu is None)
            if w.q_cu is not None:
                assert g.q_ids.tolist() == w.q_ids.tolist()
                np.testing.assert_allclose(g.q_probs, w.q_probs, rtol=1e-9)
        for a, b, drafted in zip(alone, together, want, strict=True):  # commit a prefix of the draft + a new token
            keep = drafted.tokens[: rng.randint(0, drafted.num_nodes)].tolist() + [rng.randrange(100)]
            a.tokens += keep
            b.tokens += keep


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batched", [False, True], ids=["one", "batched"])
def test_a_cuda_draft_model_drafts_on_its_own_stream(monkeypatch, batched):
    """Every forward of a CUDA draft model runs on the proposer's own stream, not the one the target's steps are
    queued on, and drafts what the same proposer drafts on the default stream."""
    from spec_helpers import tiny_llama

    from specmesh.fast_llama import FastLlamaRunner

    runner = FastLlamaRunner(tiny_llama(seed=3).float().cuda())
    prop = DraftModelProposer(runner)
    assert prop.stream is not None and prop.stream != torch.cuda.default_stream()
    seen = []
    forward_batch = runner.forward_batch

    def spy(*args, **kwargs):
        seen.append(torch.cuda.current_stream())
        return forward_batch(*args, **kwargs)

    def draft(proposer):
        states = [_state(p) for p in PROMPTS[:3]]
        if batched:
            return [t.tokens.tolist() for t in proposer.propose_batch(states, [Budget(4, 4)] * len(states))]
        return [proposer.propose(state, Budget(4, 4)).tokens.tolist() for state in states]

    monkeypatch.setattr(runner, "forward_batch", spy)
    got = draft(prop)
    assert seen and all(stream == prop.stream for stream in seen)
    default = DraftModelProposer(runner, kv=prop.kv)
    default.stream = None  # the same drafting on the default stream
    torch.cuda.synchronize()
    assert draft(default) == got
