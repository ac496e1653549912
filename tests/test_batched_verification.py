"""Batched verification: many requests' trees checked against packed target rows in one call.

Greedy: ``verify_greedy_batch`` equals ``verify_greedy`` tree by tree, on random batches.
Sampling: ``verify_sample_batch`` keeps the target's distribution. The speculative process of
tests/test_sampling_distribution.py is run for many requests side by side, every step of all
of them verified in one call (requests of different tree shapes and vocabularies in one
batch); per scenario, the first K tokens are compared with the exact target joint by a
chi-square test, and the same test must fail when the residual is skipped. A seeded request's
acceptance does not depend on what it is batched with.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling_distribution import (
    P_FAIL,
    P_PASS,
    World,
    _drafter,
    chisquare_p,
    draft_tree,
    target_rows,
)
from torch.nn.functional import one_hot, pad

from specmesh.tree import TokenTree
from verifier_service import verification
from verifier_service.verification import Acceptance, verify_greedy, verify_greedy_batch, verify_sample_batch


def packed(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Rows of each tree [num_nodes + 1, vocab] -> packed [total_rows, vocab], cu_rows [num_trees + 1]."""
    return torch.cat(rows), np.cumsum([0] + [r.shape[0] for r in rows]).tolist()


# ------------------------------------------------------------------ greedy
def random_tree(kind: str, num_nodes: int, vocab: int, with_dists: bool, seed: int) -> TokenTree:
    """kind: chain | wide (every node a child of the root) | random (any earlier parent) | empty."""
    rng = np.random.default_rng(seed)
    n = 0 if kind == "empty" else num_nodes
    parents = {"chain": np.arange(-1, n - 1), "wide": np.full(n, -1)}.get(kind)
    if parents is None:
        parents = np.asarray([rng.integers(-1, i) for i in range(n)], np.int64).reshape(n)
    tokens = rng.integers(0, vocab, n)  # siblings may repeat a token
    if not with_dists:
        return TokenTree(tokens, parents.astype(np.int64), np.ones(n), ("t",) * n)
    dists = []  # each node's token, plus a few others, with random draft probabilities
    for tok in tokens:
        ids = np.unique(np.append(rng.choice(vocab, rng.integers(0, vocab)), tok))
        dists.append((ids, rng.dirichlet(np.ones(ids.size))))
    q_cu = np.cumsum([0] + [ids.size for ids, _ in dists])
    q_ids = np.concatenate([ids for ids, _ in dists]) if dists else np.zeros(0, np.int64)
    q_probs = np.concatenate([v for _, v in dists]) if dists else np.zeros(0)
    draft_probs = np.asarray([v[ids == t][0] for (ids, v), t in zip(dists, tokens, strict=True)]).reshape(n)
    return TokenTree(tokens, parents.astype(np.int64), draft_probs, ("t",) * n, q_cu, q_ids, q_probs)


def target_logits(tree: TokenTree, vocab: int, rng: np.random.Generator) -> torch.Tensor:
    """[num_nodes + 1, vocab] float32; most rows' argmax is one of the row's children, so paths get long."""
    logits = rng.normal(size=(tree.num_nodes + 1, vocab)).astype(np.float32)
    for row in range(tree.num_nodes + 1):
        kids = tree.children_of(row - 1)
        if kids and rng.random() < 0.8:
            logits[row, tree.tokens[rng.choice(kids)]] += 10.0
    return torch.from_numpy(logits)


TREE = st.tuples(st.sampled_from(["chain", "wide", "random", "empty"]), st.integers(0, 10), st.booleans(),
                 st.integers(0, 2**32 - 1))


@settings(max_examples=150)
@given(st.lists(TREE, max_size=6), st.integers(2, 6), st.integers(0, 2**32 - 1))
def test_greedy_batch_equals_greedy_per_tree(specs, vocab, seed):
    rng = np.random.default_rng(seed)
    trees = [random_tree(kind, n, vocab, dists, s) for kind, n, dists, s in specs]
    rows = [target_logits(tree, vocab, rng) for tree in trees]
    logits, cu_rows = packed(rows) if trees else (torch.zeros(0, vocab), [0])  # an empty batch too
    expected = [verify_greedy(tree, r.argmax(dim=-1).numpy()) for tree, r in zip(trees, rows, strict=True)]
    assert verify_greedy_batch(trees, logits, cu_rows) == expected
    # a one-hot target has a single possible outcome, the greedy one: the sampler must find it too,
    # whatever the draft distributions (this pins which row each node's p(x) is read from)
    hot = one_hot(logits.argmax(dim=-1), vocab).double()
    gens = [torch.Generator().manual_seed(i) for i in range(len(trees))]
    assert verify_sample_batch(trees, hot, cu_rows, gens) == expected


@settings(max_examples=150)
@given(st.lists(TREE, min_size=1, max_size=6), st.integers(2, 6), st.integers(0, 2**32 - 1))
def test_device_sampler_walks_the_reference_rule_exactly(specs, vocab, seed):
    """``sample_trees`` (batched, on the device, p kept unnormalised with sparse residuals) accepts the same path as
    the reference walk given the same uniforms, and draws its bonus from the same distribution."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(kind, n, vocab, dists, s) for kind, n, dists, s in specs]
    rows = [torch.softmax(target_logits(tree, vocab, rng).double() * rng.uniform(0.1, 1.0), dim=-1) for tree in trees]
    probs, cu_rows = packed(rows)
    plan = verification.plan_trees(trees, cu_rows[:-1], "cpu", torch.float64)
    uniforms = torch.from_numpy(rng.random(sum(plan.sizes)))
    exponentials = torch.empty(len(trees), vocab, dtype=torch.float64).exponential_()
    got = verification.sample_trees(probs, plan, uniforms, exponentials)
    acceptances = plan.acceptances(got.host_columns().numpy())
    at = 0
    for r, (tree, tree_rows) in enumerate(zip(trees, rows, strict=True)):
        u = uniforms[at : at + tree.num_nodes].numpy()
        at += tree.num_nodes
        p_tokens = tree_rows[tree.parents + 1, tree.tokens].numpy()
        accepted, bonus_p = verification._walk_sample(tree, tree_rows, u, p_tokens)
        assert acceptances[r].accepted_nodes == tuple(accepted)
        last = accepted[-1] + 1 if accepted else 0
        assert int(got.bonus_row[r]) == cu_rows[r] + last  # the row the bonus was drawn from
        torch.testing.assert_close(got.bonus_probs[r] / got.bonus_probs[r].sum(), bonus_p, rtol=0, atol=1e-12)
        assert bonus_p[acceptances[r].bonus_token] > 0  # the race picks a token of the distribution's support
        assert int(got.num_accepted[r]) == len(accepted)


def test_empty_batch_returns_nothing():
    assert verify_greedy_batch([], torch.zeros(0, 7), [0]) == []
    assert verify_sample_batch([], torch.zeros(0, 7, dtype=torch.float64), [0], []) == []


def test_empty_trees_yield_only_their_bonus():
    trees = [TokenTree.empty(), TokenTree.chain([0]), TokenTree.empty()]
    probs = one_hot(torch.tensor([3, 0, 5, 6]), 7).double()  # the trees' rows: 1 + 2 + 1
    want = [Acceptance((), 3), Acceptance((0,), 5), Acceptance((), 6)]
    assert verify_greedy_batch(trees, probs, [0, 1, 3, 4]) == want
    assert verify_sample_batch(trees, probs, [0, 1, 3, 4], [None] * 3) == want


def test_packing_that_does_not_fit_the_trees_is_refused():
    trees = [TokenTree.chain([1, 2]), TokenTree.empty()]
    probs = torch.full((4, 3), 1 / 3, dtype=torch.float64)
    for bad in ([0, 2, 4], [0, 3], [1, 3, 4], [0, 3, 5]):
        with pytest.raises(AssertionError):
            verify_greedy_batch(trees, probs, bad)
        with pytest.raises(AssertionError):
            verify_sample_batch(trees, probs, bad, [None, None])
    with pytest.raises(AssertionError):  # probabilities, not counts
        verify_sample_batch(trees, probs.long(), [0, 3, 4], [None, None])


# ---------------------------------------------------------------- sampling
# (vocab, widths, mode, k). Modes as in test_sampling_distribution (iid, wor: with draft distributions;
# topk: point masses), plus mixed (a point mass then i.i.d. siblings) and empty trees (bonus only).
# All run in the same batches; a vocabulary smaller than the batch's has its extra tokens at p = 0.
SCENARIOS = {
    "chain3_iid": (4, (1, 1, 1), "iid", 3),
    "chain2_iid": (5, (1, 1), "iid", 2),
    "tree_iid_siblings": (5, (3, 2), "iid", 2),
    "tree_wor_siblings": (5, (3, 2), "wor", 2),
    "tree_wor_whole_vocab": (4, (4, 1), "wor", 2),
    "tree_topk_siblings": (5, (3, 2), "topk", 2),
    "tree_topk_deep": (4, (2, 2, 1), "topk", 3),
    "tree_mixed": (5, (3, 2), "mixed", 2),
    "empty_trees": (5, (), "iid", 2),
}
BATCH_VOCAB = 5
TRIALS = 6_000
NEGATIVE_TRIALS = 1_500
LANES_PER_BATCH = 300  # requests side by side; each step of all of them is one verify_sample_batch call


def simulate_batched(names: list[str], trials: int, seed: int) -> dict[str, Counter]:
    """``trials`` runs of every scenario's speculative process, run as requests of shared batches,
    each with its own generator; per scenario, the counts of its first k tokens."""
    rng = random.Random(seed)
    worlds = {name: World(SCENARIOS[name][0], seed=sum(map(ord, name))) for name in names}
    lanes = [(name, trial) for trial in range(trials) for name in names]
    counts: dict[str, Counter] = {name: Counter() for name in names}
    for start in range(0, len(lanes), LANES_PER_BATCH):
        batch = lanes[start : start + LANES_PER_BATCH]
        gens = [torch.Generator().manual_seed(seed * 10**7 + start + i) for i in range(len(batch))]
        outs: list[list[int]] = [[] for _ in batch]
        while live := [i for i, (name, _) in enumerate(batch) if len(outs[i]) < SCENARIOS[name][3]]:
            rng.shuffle(live)  # a request's place in its batch changes from step to step
            trees, rows = [], []
            for i in live:
                name = batch[i][0]
                world, (_, widths, mode, _) = worlds[name], SCENARIOS[name]
                prefix = tuple(outs[i])
                tree = _drafter(widths, mode)(world, prefix, rng)
                if batch[i][1] < 20:  # the drafted trees keep the TokenTree contract
                    tree.validate(world.vocab)
                trees.append(tree)
                rows.append(pad(target_rows(world, prefix, tree), (0, BATCH_VOCAB - world.vocab)))
            probs, cu_rows = packed(rows)
            accs = verify_sample_batch(trees, probs, cu_rows, [gens[i] for i in live])
            for i, tree, acc in zip(live, trees, accs, strict=True):
                if acc.accepted_nodes:  # an accepted path is a root-to-node path
                    assert list(acc.accepted_nodes) == tree.path_to(acc.accepted_nodes[-1])
                outs[i] += acc.tokens(tree)
        for (name, _), out in zip(batch, outs, strict=True):
            counts[name][tuple(out[: SCENARIOS[name][3]])] += 1
    return counts


@pytest.mark.slow
def test_batched_sampling_matches_target_distribution():
    counts = simulate_batched(list(SCENARIOS), TRIALS, seed=7)
    for name, (vocab, _, _, k) in SCENARIOS.items():
        world = World(vocab, seed=sum(map(ord, name)))
        pvalue = chisquare_p(counts[name], world.joint(k))
        assert pvalue > P_PASS, f"{name}: p = {pvalue:.2e}"


def test_negative_control_residual_equal_to_p_is_detected(monkeypatch):
    # rejected mass goes back to p
    monkeypatch.setattr(verification, "residual_sparse", lambda p, total, q_ids, q_vals, q_real, rejected: (p, total))
    names = ["chain2_iid", "tree_iid_siblings", "tree_topk_siblings", "tree_mixed"]
    counts = simulate_batched(names, NEGATIVE_TRIALS, seed=7)
    for name in names:
        vocab, _, _, k = SCENARIOS[name]
        pvalue = chisquare_p(counts[name], World(vocab, seed=sum(map(ord, name))).joint(k))
        assert pvalue < P_FAIL, f"{name}: p = {pvalue:.2e}"


def test_seeded_request_is_reproducible_whatever_its_batch():
    world = World(5, seed=11)
    rng = random.Random(0)
    outcomes = set()
    for seed in range(150):
        tree = draft_tree(world, (), (3, 2), "mixed", rng)
        others = [draft_tree(world, (1,), (2, 2), "wor", rng), TokenTree.empty(),
                  draft_tree(world, (2,), (3,), "topk", rng)]
        probs, cu_rows = packed([target_rows(world, (), tree)])
        alone = verify_sample_batch([tree], probs, cu_rows, [torch.Generator().manual_seed(seed)])[0]
        batch = [others[0], tree, others[1], others[2]]
        probs, cu_rows = packed([target_rows(world, (1,), others[0]), target_rows(world, (), tree),
                                 target_rows(world, (), others[1]), target_rows(world, (2,), others[2])])
        gens = [torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed), None,
                torch.Generator().manual_seed(10**6 + seed)]
        assert verify_sample_batch(batch, probs, cu_rows, gens)[1] == alone
        outcomes.add(alone)
    assert len(outcomes) > 10  # not one fixed outcome: paths and bonus tokens vary with the seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_on_cuda_match_the_cpu_rule():
    vocab = 6
    kinds = ["chain", "wide", "random", "empty"]
    trees = [random_tree(kind, 7, vocab, True, seed) for seed, kind in enumerate(kinds)]
    rng = np.random.default_rng(0)
    logits, cu_rows = packed([target_logits(tree, vocab, rng) for tree in trees])
    assert verify_greedy_batch(trees, logits.cuda(), cu_rows) == verify_greedy_batch(trees, logits, cu_rows)
    probs = torch.softmax(logits.double(), dim=-1).cuda()
    results = [
        verify_sample_batch(trees, probs, cu_rows, [torch.Generator("cuda").manual_seed(i) for i in range(4)])
        for _ in range(2)
    ]
    assert results[0] == results[1]  # seeded CUDA generators: the same draws
    hot = one_hot(logits.argmax(dim=-1), vocab).double().cuda()
    assert verify_sample_batch(trees, hot, cu_rows, [None] * 4) == verify_greedy_batch(trees, logits, cu_rows)


def test_decisions_warp_each_request_with_its_own_parameters():
    """The step warps sampled requests per group of equal parameters: each one's rows are still its own warp."""
    from specmesh.sampling import SamplingParams
    from specmesh.warp import warp_probs
    from verifier_service.decisions import SAMPLING_DTYPE, Decisions, HostCopy, Item

    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=2.0)]
    trees = [TokenTree.chain([1, 2]), TokenTree.empty(), TokenTree.chain([3]), TokenTree.chain([4, 5, 6]),
             TokenTree.empty()]
    items, first = [], 0
    for sp, tree in zip(params, trees, strict=True):
        items.append(Item(sp, None, tree, first))
        first += tree.num_nodes + 1
    logits = torch.randn(first, 50, generator=torch.Generator().manual_seed(0))
    decisions = Decisions(items, logits, logits.argmax(dim=-1), HostCopy())
    sampled = [i for i, sp in enumerate(params) if not sp.greedy]
    got = decisions._warped(logits)
    want = torch.cat([warp_probs(logits[items[i].first : items[i].first + trees[i].num_nodes + 1],
                                 params[i].temperature, params[i].top_k, params[i].top_p, dtype=SAMPLING_DTYPE)
                      for i in sampled])
    torch.testing.assert_close(got, want)
