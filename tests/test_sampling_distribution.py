"""Lossless sampling: speculative output has exactly the target's distribution.

Synthetic part: ``verify_sample`` on tiny vocabularies, where the target p and the draft q
are random tables keyed by the prefix. The whole speculative process (draft a tree at
random from q, verify it against p, repeat from the new prefix) is simulated, and the
distribution of the first K generated tokens is compared with the exact target joint by
a chi-square test. Negative controls (wrong residual, inflated acceptance) must fail the
same test, so the test has the power to see a broken rule.

End-to-end part: the engine core with tiny Llama models, temperature 1 (plus top-k / top-p), the
first generated tokens against the exact autoregressive distribution of the same model.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from orchestrator.policy import StaticPolicy
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.warp import warp_probs
from verifier_service import verification
from verifier_service.verification import verify_sample
from verifier_service.verifier import LocalVerifier

P_PASS = 1e-3  # a correct rule must pass at this level (fixed seeds: deterministic)
P_FAIL = 1e-6  # a broken rule must fail at this level


# ------------------------------------------------------------------ world
class World:
    """Target p(. | prefix) and draft q(. | prefix) over a tiny vocabulary, fixed per prefix.

    Some entries are exactly zero in p or in q (supports differ), as with top-k/top-p warping.
    """

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed
        self._p: dict[tuple, np.ndarray] = {}
        self._q: dict[tuple, np.ndarray] = {}

    def _table(self, which: int, prefix: tuple, cache: dict) -> np.ndarray:
        if prefix not in cache:
            rng = np.random.default_rng([self.seed, which, len(prefix), *prefix])
            d = rng.dirichlet(np.full(self.vocab, 0.7))
            if rng.random() < 0.5:  # knock one token out of the support
                d[rng.integers(self.vocab)] = 0.0
            cache[prefix] = d / d.sum()
        return cache[prefix]

    def p(self, prefix: tuple) -> np.ndarray:
        return self._table(0, prefix, self._p)

    def q(self, prefix: tuple) -> np.ndarray:
        return self._table(1, prefix, self._q)

    def joint(self, k: int) -> dict[tuple, float]:
        out = {}
        for seq in itertools.product(range(self.vocab), repeat=k):
            prob = 1.0
            for i in range(k):
                prob *= self.p(seq[:i])[seq[i]]
            out[seq] = prob
        return out


# ------------------------------------------------------------ tree drafting
def _sparse(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    support = np.flatnonzero(d)
    return support.astype(np.int64), d[support]


def _pick(d: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from d with the uniform u (never lands on a zero-probability token)."""
    acc, last = 0.0, -1
    u *= float(d.sum())
    for tok, w in enumerate(d.tolist()):
        if w > 0:
            acc += w
            last = tok
            if u < acc:
                return tok
    return last


def draft_tree(world: World, prefix: tuple, widths: tuple[int, ...], mode: str, rng) -> TokenTree:
    """Children per level ``widths``; mode: iid (with replacement) | wor (without) | topk (deterministic) |
    mixed (first child the draft's most likely token as a point mass, the others i.i.d. from q).

    Each node ships the exact distribution its token was drawn from, conditioned on the
    siblings drawn before it (the TokenTree convention); topk nodes ship none (point masses).
    """
    tokens: list[int] = []
    parents: list[int] = []
    dists: list[tuple[np.ndarray, np.ndarray]] = []
    frontier = [(-1, ())]
    for width in widths:
        nxt = []
        for node, path in frontier:
            q = world.q(prefix + path)
            picks = []
            if mode == "iid":
                sparse = _sparse(q)
                picks = [(_pick(q, rng.random()), sparse) for _ in range(width)]
            elif mode == "wor":
                left = q.copy()
                for _ in range(min(width, int((q > 0).sum()))):
                    cond = left / left.sum()  # q renormalised after removing earlier siblings
                    tok = _pick(cond, rng.random())
                    picks.append((tok, _sparse(cond)))
                    left[tok] = 0.0
            elif mode == "topk":
                picks = [(int(t), None) for t in np.argsort(-q, kind="stable")[:width]]
            elif mode == "mixed":
                top = int(np.argmax(q))
                picks = [(top, (np.asarray([top], np.int64), np.ones(1)))]
                picks += [(_pick(q, rng.random()), _sparse(q)) for _ in range(width - 1)]
            else:
                raise ValueError(mode)
            for tok, dist in picks:
                tokens.append(tok)
                parents.append(node)
                dists.append(dist)
                nxt.append((len(tokens) - 1, path + (tok,)))
        frontier = nxt
    n = len(tokens)
    toks, pars = np.asarray(tokens, np.int64), np.asarray(parents, np.int64)
    if mode == "topk":
        return TokenTree(toks, pars, np.ones(n), ("t",) * n)
    sizes = [ids.size for ids, _ in dists]
    q_ids = np.concatenate([ids for ids, _ in dists])
    q_probs = np.concatenate([v for _, v in dists])
    q_cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    probs = np.asarray([v[ids == t][0] for (ids, v), t in zip(dists, tokens, strict=True)])
    return TokenTree(toks, pars, probs, ("t",) * n, q_cu=q_cu, q_ids=q_ids, q_probs=q_probs)


def target_rows(world: World, prefix: tuple, tree: TokenTree) -> torch.Tensor:
    """[num_nodes + 1, vocab]: p at the root, then p after each node's path."""
    paths: list[tuple] = []
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for tok, par in zip(tokens, parents, strict=True):
        paths.append((paths[par] if par >= 0 else prefix) + (tok,))
    rows = [world.p(prefix)] + [world.p(path) for path in paths]
    return torch.from_numpy(np.stack(rows))


def simulate(world: World, drafter: Callable, k: int, trials: int, seed: int, verify=verify_sample) -> Counter:
    """Run the speculative process until k tokens exist, ``trials`` times; count the k-token prefixes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for trial in range(trials):
        out: list[int] = []
        while len(out) < k:
            prefix = tuple(out)
            tree = drafter(world, prefix, rng)
            if trial < 50:  # the drafted trees keep the TokenTree contract
                tree.validate(world.vocab)
            acc = verify(tree, target_rows(world, prefix, tree), gen)
            if acc.accepted_nodes:  # an accepted path is a root-to-node path
                assert list(acc.accepted_nodes) == tree.path_to(acc.accepted_nodes[-1])
            out += acc.tokens(tree)
        counts[tuple(out[:k])] += 1
    return counts


def chisquare_p(counts: Counter, joint: dict[tuple, float]) -> float:
    """Goodness of fit of ``counts`` to ``joint``; cells with expected count < 5 pooled into one."""
    total = sum(counts.values())
    assert set(counts) <= {s for s, pr in joint.items() if pr > 0}, "a sequence with target probability 0 came out"
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, pr in joint.items():
        if pr * total >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(pr * total)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += pr * total
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    exp = np.asarray(exp) * (total / sum(exp))
    return float(stats.chisquare(obs, exp).pvalue)


# ----------------------------------------------------------- the scenarios
# (name, vocab, widths, mode, k): chains of depth 2-3 and trees of several shapes
SCENARIOS = {
    "chain3_iid": (4, (1, 1, 1), "iid", 3),
    "chain2_iid": (5, (1, 1), "iid", 2),
    "tree_iid_siblings": (5, (3, 2), "iid", 2),
    "tree_wor_siblings": (5, (3, 2), "wor", 2),
    "tree_wor_whole_vocab": (4, (4, 1), "wor", 2),
    "tree_topk_siblings": (5, (3, 2), "topk", 2),
    "tree_topk_deep": (4, (2, 2, 1), "topk", 3),
}
TRIALS = 15_000
NEGATIVE_TRIALS = 4_000  # broken rules fail by hundreds of orders of magnitude


def _drafter(widths, mode):
    if not widths:  # no draft: the bonus token alone
        return lambda world, prefix, rng: TokenTree.empty()
    return lambda world, prefix, rng: draft_tree(world, prefix, widths, mode, rng)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(name):
    vocab, widths, mode, k = SCENARIOS[name]
    world = World(vocab, seed=sum(map(ord, name)))
    counts = simulate(world, _drafter(widths, mode), k, TRIALS, seed=7)
    pvalue = chisquare_p(counts, world.joint(k))
    assert pvalue > P_PASS, f"{name}: p = {pvalue:.2e}"


# ----------------------------------------------------------- negative controls
def _residual_is_p(p, q_ids, q_vals):
    return p  # forget to subtract q: rejected mass is redistributed wrongly


def _verify_inflated(tree, target_probs, generator):
    """verify_sample with acceptance min(1, 1.5 p/q): accepts too often."""
    accepted, node = [], -1
    while True:
        p = target_probs[node + 1]
        chosen = None
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            q_ids, q_vals = tree.draft_dist(child)
            q_x = float(q_vals[q_ids == x][0])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * q_x < 1.5 * float(p[x]):
                chosen = child
                break
            p = verification.residual(p, torch.as_tensor(q_ids), torch.as_tensor(q_vals, dtype=torch.float64))
        if chosen is None:
            return verification.Acceptance(tuple(accepted), int(torch.multinomial(p, 1, generator=generator)))
        accepted.append(chosen)
        node = chosen


@pytest.mark.parametrize("name", ["chain2_iid", "tree_iid_siblings", "tree_topk_siblings"])
def test_negative_control_residual_equal_to_p_is_detected(name, monkeypatch):
    monkeypatch.setattr(verification, "residual", _residual_is_p)
    vocab, widths, mode, k = SCENARIOS[name]
    world = World(vocab, seed=sum(map(ord, name)))
    counts = simulate(world, _drafter(widths, mode), k, NEGATIVE_TRIALS, seed=7)
    assert chisquare_p(counts, world.joint(k)) < P_FAIL


@pytest.mark.parametrize("name", ["chain2_iid", "tree_wor_siblings"])
def test_negative_control_inflated_acceptance_is_detected(name):
    vocab, widths, mode, k = SCENARIOS[name]
    world = World(vocab, seed=sum(map(ord, name)))
    counts = simulate(world, _drafter(widths, mode), k, NEGATIVE_TRIALS, seed=7, verify=_verify_inflated)
    assert chisquare_p(counts, world.joint(k)) < P_FAIL


# ------------------------------------------------------ exact single-step law
def test_single_step_output_law_is_exact():
    """One verify step on a 2-sibling i.i.d. tree: P(first token = x) computed in closed form equals p."""
    world = World(4, seed=3)
    p, q = world.p(()), world.q(())
    # P(out = x) = sum over both draws of the rejection cascade, enumerated exactly
    law = np.zeros(4)
    for a, b in itertools.product(range(4), repeat=2):
        w = q[a] * q[b]
        if w == 0:
            continue
        acc_a = min(1.0, p[a] / q[a])
        law[a] += w * acc_a
        r1 = np.maximum(p - q, 0)
        r1 = r1 / r1.sum() if r1.sum() > 0 else p
        acc_b = min(1.0, r1[b] / q[b])
        law[b] += w * (1 - acc_a) * acc_b
        r2 = np.maximum(r1 - q, 0)
        r2 = r2 / r2.sum() if r2.sum() > 0 else r1
        law += w * (1 - acc_a) * (1 - acc_b) * r2
    np.testing.assert_allclose(law, p, atol=1e-12)


def test_point_mass_with_certain_target_always_accepts():
    tree = TokenTree.chain([2, 0])
    rows = torch.zeros(3, 4, dtype=torch.float64)
    rows[0, 2] = rows[1, 0] = rows[2, 3] = 1.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        acc = verify_sample(tree, rows, gen)
        assert acc.accepted_nodes == (0, 1) and acc.bonus_token == 3


def test_zero_target_probability_is_never_accepted():
    # q proposes token 1 surely; p forbids it
    tree = TokenTree(np.asarray([1], np.int64), np.asarray([-1], np.int64), np.ones(1), ("t",),
                     q_cu=np.asarray([0, 2], np.int64), q_ids=np.asarray([1, 3], np.int64), q_probs=np.asarray([0.9, 0.1]))
    rows = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.25] * 4], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    outs = Counter(verify_sample(tree, rows, gen).tokens(tree)[0] for _ in range(2000))
    assert set(outs) <= {0, 2}


# ------------------------------------------------------------------ warping
def ref_warp(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then keep the top_k largest logits (ties kept), then the smallest set of the
    most probable tokens whose mass reaches top_p; renormalise."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, dtype=bool)
    if 0 < top_k < x.size:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs = e / e.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        mass = 0.0
        kept = np.zeros_like(keep)
        for t in order:
            if mass >= top_p:
                break
            kept[t] = True
            mass += probs[t]
        probs = np.where(kept, probs, 0.0)
        probs = probs / probs.sum()
    return probs


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 12),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    st.integers(0, 13),
    st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2, 0.01]),
)
def test_warp_probs_matches_reference(vocab, seed, temperature, top_k, top_p):
    logits = np.random.default_rng(seed).normal(0, 2, size=vocab).astype(np.float32)  # runners return float32
    ref = ref_warp(logits, temperature, top_k, top_p)
    # boundaries of top-p are ill-conditioned: skip draws whose cumulative mass is within 1e-9 of top_p
    cum = np.cumsum(np.sort(ref_warp(logits, temperature, top_k, 1.0))[::-1])
    if np.any(np.abs(cum - top_p) < 1e-9):
        return
    got = warp_probs(torch.from_numpy(logits), temperature, top_k, top_p)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-9)
    assert abs(float(got.sum()) - 1.0) < 1e-12


def test_warp_probs_batched_rows_are_independent():
    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batched = warp_probs(logits, 0.8, 4, 0.7)
    for i in range(5):
        torch.testing.assert_close(batched[i], warp_probs(logits[i], 0.8, 4, 0.7))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.05, 0.3, 1.0, 4.0]), st.sampled_from([0.99, 0.95, 0.5, 0.05]),
       st.sampled_from([torch.float32, torch.float64]))
def test_cpu_top_p_shortcut_keeps_the_same_tokens(seed, spread, top_p, dtype):
    """The CPU's top-p from each row's top TOP_P_CANDIDATES equals the full sort's: rows peaked (decided among
    the candidates) and flat (spread 0.05: the prefix goes past them, the full sort decides) in one batch."""
    from specmesh import warp

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3 * warp.TOP_P_CANDIDATES, generator=gen)
    logits[::2] *= spread
    logits[1::2] *= 4.0
    fast = warp._top_p_drop_cpu(torch.softmax(logits.to(dtype), -1), top_p)
    full = warp._top_p_drop(torch.softmax(logits.to(dtype), -1), top_p)
    assert torch.equal(fast, full)
    assert (~fast).any(dim=-1).all()  # at least one token kept per row


def test_a_denormal_temperature_decodes_greedily(e2e_models):
    """Dividing logits by a temperature near 0 overflows: below GREEDY_BELOW (vLLM's epsilon) a request is greedy."""
    from spec_helpers import engine_for

    assert SamplingParams(temperature=2.2e-313).greedy and not SamplingParams(temperature=1e-4).greedy
    engine = engine_for(e2e_models[1], "draft_model", 4, 2, draft_runner=e2e_models[2])
    tiny = engine.generate(E2E_PROMPT, SamplingParams(temperature=2.2e-313, top_p=0.5, max_new_tokens=6,
                                                      ignore_eos=True))
    assert tiny.token_ids == engine.generate(E2E_PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True)).token_ids


def test_sampling_params_reject_bad_values():
    for kw in ({"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_k": -1},
               {"top_p": 0.0}, {"top_p": float("nan")},
               {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# ------------------------------------------------------------- end to end
# The engine core + tiny Llama models (vocab 8), temperature 1 and warped: the two tokens produced by speculation
# (2nd and 3rd generated; the 1st comes from the prefill) against the exact autoregressive law
# and against autoregressive samples of the same engine stack.
E2E_VOCAB = 8
E2E_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: prompt lookup always has a candidate
E2E_SAMPLES = 1500
WARPS = {"plain": (1.0, 0, 1.0), "topk_topp": (0.8, 5, 0.9)}  # (temperature, top_k, top_p)


@pytest.fixture(scope="module")
def e2e_models():
    from spec_helpers import make_runner, perturbed, tiny_llama

    target = tiny_llama(seed=5, vocab=E2E_VOCAB, hidden=32, heads=2, kv_heads=1, intermediate=64)
    draft = perturbed(target, seed=6, rel_noise=0.5)  # accepted about half the time
    # the lean runner: the embedded default, and half the cost of the HF forward at this size
    return target, make_runner(target, "fast"), make_runner(draft, "fast")


def exact_pair_law(model, prompt: list[int], warp: tuple[float, int, float]) -> dict[tuple, float]:
    """P(2nd, 3rd generated token) under autoregressive sampling, marginalised over the 1st."""
    temperature, top_k, top_p = warp
    v = model.config.vocab_size

    @torch.no_grad()
    def probs(prefixes: list[list[int]]) -> np.ndarray:
        logits = model(torch.tensor(prefixes)).logits[:, -1].double().numpy()
        return np.stack([ref_warp(row, temperature, top_k, top_p) for row in logits])

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(v)])  # [v, v]
    p3 = probs([prompt + [a, b] for a in range(v) for b in range(v)]).reshape(v, v, v)
    law = np.einsum("a,ab,abc->bc", p1, p2, p3)
    return {(b, c): float(law[b, c]) for b in range(v) for c in range(v)}


def proposer_options(proposer: str | None) -> tuple[str | None, dict]:
    """"NAME:key=value,..." -> (NAME, the proposer's options); None -> (None, {}) (plain decoding)."""
    name, _, options = (proposer or "").partition(":")
    opts = dict(kv.split("=") for kv in options.split(",")) if options else {}
    return name or None, {k: int(v) if v.isdigit() else v for k, v in opts.items()}


def sample_pairs_on_core(target_runner, proposer, draft_runner, warp, n: int, seed0: int,
                         overlap: bool = False) -> tuple[Counter, float]:
    """(counts of the 2nd and 3rd generated tokens of ``n`` seeded samples, acceptance: draft tokens accepted per
    step) on the engine core: the ``n`` requests run ``spec_helpers.CORE_IN_FLIGHT`` at a time (batched forwards,
    one drafter serving them all; ``proposer`` None: plain decoding)."""
    from spec_helpers import results_on_core, window_for

    from drafter_service.drafter import LocalDrafter
    from drafter_service.proposer import make_proposer
    from orchestrator.drafter_link import only
    from orchestrator.requests import Method

    temperature, top_k, top_p = warp
    name, opts = proposer_options(proposer)
    if name is None:  # plain decoding on the same core
        verifier, method = LocalVerifier(target_runner), Method()
    else:
        prop = make_proposer(name, draft_runner=draft_runner, **opts)
        verifier = LocalVerifier(target_runner, feedback_topk=prop.feedback_topk, lookahead=window_for(prop))
        method = Method(only(LocalDrafter(prop), name), StaticPolicy(4, 2, restart_depth=0 if overlap else None),
                        strict=True, overlap=overlap)
    jobs = [(E2E_PROMPT, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed0 + i,
                                        max_new_tokens=4, ignore_eos=True)) for i in range(n)]
    counts: Counter = Counter()
    accepted = steps = 0
    for result in results_on_core(verifier, method, jobs):
        assert len(result.token_ids) == 4
        counts[tuple(result.token_ids[1:3])] += 1
        accepted += sum(s.num_accepted for s in result.stats.steps)
        steps += result.stats.num_steps
    return counts, accepted / max(steps, 1)


def assert_same_law_as_autoregressive(counts: Counter, ar: Counter, law: dict[tuple, float]) -> None:
    """``counts`` fit the exact law, and (two-sample test) autoregressive samples of the same stack."""
    assert chisquare_p(counts, law) > P_PASS
    cells = [c for c in law if counts.get(c, 0) + ar.get(c, 0) >= 10]
    rest = [sum(x.get(c, 0) for c in law if c not in cells) for x in (counts, ar)]
    table = np.array([[counts.get(c, 0) for c in cells] + [rest[0]], [ar.get(c, 0) for c in cells] + [rest[1]]])
    table = table[:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > P_PASS


@pytest.fixture(scope="module")
def ar_pairs(e2e_models):
    """warp name -> autoregressive samples on the engine core, drawn on first use (inside a test, single-threaded)."""
    _, target_runner, _ = e2e_models
    memo: dict[str, Counter] = {}

    def get(name: str) -> Counter:
        if name not in memo:
            memo[name] = sample_pairs_on_core(target_runner, None, None, WARPS[name], E2E_SAMPLES, seed0=10**6)[0]
        return memo[name]

    return get


# Every proposer family on the engine core, which `generate`, `bench` and `serve` run: CORE_IN_FLIGHT requests
# in flight, batched forwards, one drafter for all of them (and PEARL's overlap where marked)
CORE_CASES = [
    ("draft_model", "plain", False), ("draft_model_tree", "plain", False), ("prompt_lookup", "plain", False),
    ("draft_model", "topk_topp", False), ("draft_model", "plain", True), ("draft_model_tree", "plain", True),
    ("draft_model_tree", "topk_topp", True),
    # learning proposers: trees built from earlier requests' samples (store, top-k table, calibration)
    ("retrieval:span=2,min_n=1", "plain", False), ("recycling", "plain", False),
    ("fused:members=copy+recycling+draft_model", "plain", False),
    ("fused", "topk_topp", True),
    # Jacobi: deterministic guesses (the target's greedy predictions), point masses to the verifier
    ("jacobi", "plain", False), ("jacobi", "topk_topp", True),
    # lookahead: pool n-grams from the prompt and the verifier's window (argmax only), point masses; 4 tokens
    # are too few for a deeper window's n-grams to be used (N = 3 keeps seeded samples: test_verifier_feedback)
    ("lookahead:window=3,ngram=2", "plain", False), ("lookahead:window=3,ngram=2", "topk_topp", False),
]


@pytest.mark.parametrize("proposer,warp,overlap", CORE_CASES)
def test_core_sampling_matches_autoregressive(e2e_models, ar_pairs, proposer, warp, overlap):
    model, target_runner, draft_runner = e2e_models
    counts, acceptance = sample_pairs_on_core(target_runner, proposer, draft_runner, WARPS[warp], E2E_SAMPLES,
                                              seed0=0, overlap=overlap)
    # speculation was really exercised (not all rejected); with overlap most steps restart with no tree
    assert acceptance > (0.005 if overlap else 0.02)
    assert_same_law_as_autoregressive(counts, ar_pairs(warp), exact_pair_law(model, E2E_PROMPT, WARPS[warp]))


def test_autoregressive_sampling_matches_exact_law(e2e_models, ar_pairs):
    model = e2e_models[0]
    for name, warp in WARPS.items():
        assert chisquare_p(ar_pairs(name), exact_pair_law(model, E2E_PROMPT, warp)) > P_PASS, name


@pytest.mark.parametrize("warp", [(1.0, 3, 1.0), (1.0, 0, 0.4), (0.7, 4, 0.6)], ids=["top_k", "top_p", "all"])
def test_the_verifier_warps_p_as_the_draft_warps_q(e2e_models, warp):
    """A fast tie between the two sides of lossless sampling: the verifier samples and accepts only inside
    the support of p = warp_probs(target logits), the function the draft model ships q from (checked in
    test_draft_model). A verifier skipping top-k or top-p on p fails here in a second, where the distribution
    tests above take minutes to see it."""
    model, target_runner, _ = e2e_models
    temperature, top_k, top_p = warp

    @torch.no_grad()
    def support(context: list[int]) -> set[int]:
        logits = model(torch.tensor([context])).logits[0, -1].double()
        return set(torch.nonzero(warp_probs(logits, temperature, top_k, top_p)).flatten().tolist())

    verifier = LocalVerifier(target_runner)
    cut = 0
    for seed in range(60):
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=4)
        first = verifier.prefill("s", E2E_PROMPT, sp).first_token
        assert first in support(E2E_PROMPT)  # sampled from p after the prompt
        allowed = support(E2E_PROMPT + [first])
        outside = [t for t in range(E2E_VOCAB) if t not in allowed]
        cut += bool(outside)
        # a drafted token p gives no mass is never accepted (point mass: accepted with p(x) / 1)
        tree = TokenTree.chain(outside[:1] or [first])
        result = verifier.verify("s", tree)
        if outside:
            assert result.num_accepted == 0
        assert result.tokens[-1] in (allowed if not result.num_accepted else support(E2E_PROMPT + [first] + list(result.tokens[:-1])))
        verifier.release("s")
    assert cut > 30  # the warp really cut tokens off
