"""Logit processors (logit_bias, repetition / frequency / presence penalties) under speculation.

The processors change the target's distribution; speculation must decode exactly that distribution: greedy output
equals plain greedy decoding with the same options (a naive full recompute applying a reference implementation of
the processors), for every proposer and in batched steps, and sampled output has the processed law (chi-square).
The processors see, at each verified row, the output so far plus the tree path to that row.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from spec_helpers import batched_events, engine_for, greedy, make_prompts
from test_sampling_distribution import E2E_PROMPT, E2E_VOCAB, P_PASS, chisquare_p, ref_warp

from drafter_service.proposer import make_proposer, proposer_names
from specmesh.logits_process import ContextCounts, process_logits, processes_logits
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.wire import sampling_from_proto, sampling_to_proto
from verifier_service.verifier import LocalVerifier

MAX_NEW = 24
PROMPTS = make_prompts(4, seed=7)
OPTIONS = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "repetition": dict(repetition_penalty=1.6),
    "bias": dict(logit_bias=((3, 4.0), (17, -100.0), (40, 2.5))),
    "all": dict(presence_penalty=-0.4, frequency_penalty=1.1, repetition_penalty=0.8, logit_bias=((5, 3.0),)),
}


# ---------------------------------------------------------------- reference
def ref_process(row: np.ndarray, sp: SamplingParams, prompt, output) -> np.ndarray:
    """One row of logits processed token by token, from the definitions (logits_process.py's docstring)."""
    x = row.astype(np.float64).copy()
    for token, value in sp.logit_bias:
        x[token] += value
    if sp.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = x[token] / sp.repetition_penalty if x[token] > 0 else x[token] * sp.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= sp.frequency_penalty * count + sp.presence_penalty
    return x


@torch.no_grad()
def naive_processed_greedy(model, prompt, num_new: int, sp: SamplingParams) -> list[int]:
    """Plain greedy decoding with the processors: the whole sequence recomputed every step, no cache."""
    ids, out = list(prompt), []
    for _ in range(num_new):
        row = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        tok = int(np.argmax(ref_process(row, sp, prompt, out)))
        ids.append(tok)
        out.append(tok)
    return out


# ---------------------------------------------------------------- the pure function
@pytest.mark.parametrize("name", list(OPTIONS))
def test_process_logits_matches_the_definitions_row_by_row(name):
    rng = np.random.default_rng(0)
    vocab, rows = 50, 6
    sp = SamplingParams(**OPTIONS[name])
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)) * 3)
    prompt = rng.integers(vocab, size=12).tolist()
    output = rng.integers(vocab, size=9).tolist()
    extra_tokens = [rng.integers(vocab, size=r).tolist() for r in range(rows)]  # row r: r more tokens
    in_context = torch.zeros(vocab, dtype=torch.bool)
    in_context[prompt + output] = True
    counts = torch.zeros(vocab, dtype=torch.float64)
    for t in output:
        counts[t] += 1
    pairs = Counter((r, t) for r, tokens in enumerate(extra_tokens) for t in tokens)
    extra = (torch.tensor([r for r, _ in pairs]), torch.tensor([t for _, t in pairs]),
             torch.tensor(list(pairs.values()), dtype=torch.float64))
    got = process_logits(logits, sp, in_context, counts, extra)
    for r in range(rows):
        want = ref_process(logits[r].numpy(), sp, prompt, output + extra_tokens[r])
        np.testing.assert_allclose(got[r].numpy(), want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(got, logits)  # the options did something


def test_tree_rows_see_their_own_paths():
    """ContextCounts.apply: row 0 (after the pending token) sees the output; row 1 + i also node i's path."""
    rng = np.random.default_rng(1)
    vocab = 30
    sp = SamplingParams(**OPTIONS["all"])
    prompt, output = [1, 2, 3, 4], [5, 6, 5]
    tree = TokenTree(np.array([7, 5, 9, 6, 5, 2]), np.array([-1, -1, 0, 0, 3, 1]), np.full(6, 0.5))
    context = ContextCounts(sp, prompt, vocab, torch.device("cpu"))
    context.add_output(output)
    logits = torch.from_numpy(rng.normal(size=(1 + tree.num_nodes, vocab)) * 2).float()
    got = context.apply(logits, tree.tokens, tree.ancestor_mask)
    paths = [[]] + [[int(tree.tokens[j]) for j in tree.path_to(i)] for i in range(tree.num_nodes)]
    for r, path in enumerate(paths):
        want = ref_process(logits[r].numpy(), sp, prompt, output + path)
        np.testing.assert_allclose(got[r].numpy(), want, rtol=1e-5, atol=1e-4)


def test_processes_logits_and_the_wire():
    assert not processes_logits(SamplingParams())
    for options in OPTIONS.values():
        sp = SamplingParams(temperature=0.7, **options)
        assert processes_logits(sp)
        assert sampling_from_proto(sampling_to_proto(sp)) == sp


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                                {"repetition_penalty": float("nan")}, {"logit_bias": ((1, 101.0),)},
                                {"logit_bias": ((-1, 1.0),)}, {"logit_bias": ((1, 1.0), (1, 2.0))},
                                {"logit_bias": tuple((i, 1.0) for i in range(301))}])
def test_bad_processor_options_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_the_verifier_refuses_a_bias_past_the_vocabulary(model_sets):
    verifier = LocalVerifier(model_sets("random").runner("target", "fast"))
    with pytest.raises(ValueError, match="logit_bias"):
        verifier.admit("s", [1, 2, 3], SamplingParams(logit_bias=((10**6, 1.0),)))


# ---------------------------------------------------------------- greedy: every proposer
@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_plain_decoding_with_processors_matches_the_naive_reference(model_sets, name, backend):
    ms = model_sets("cyclic")
    engine = engine_for(ms.runner("target", backend))
    changed = 0
    for prompt in PROMPTS:
        sp = greedy(MAX_NEW, **OPTIONS[name])
        got = engine.generate(prompt, sp).token_ids
        assert got == naive_processed_greedy(ms.target, prompt, MAX_NEW, sp)
        changed += got != engine.generate(prompt, greedy(MAX_NEW)).token_ids
    assert changed  # the options changed what the model says


@pytest.mark.parametrize("proposer", proposer_names())
def test_speculative_greedy_with_processors_equals_plain_decoding(model_sets, proposer):
    kind = "random" if proposer.startswith("draft_model") else "cyclic"
    ms = model_sets(kind)
    target = ms.runner("target", "fast")
    engine = engine_for(target, proposer, 12, 5, draft_runner=ms.runner("near", "fast"))
    plain = engine_for(target)
    accepted = 0
    for name, options in OPTIONS.items():
        for i, prompt in enumerate(PROMPTS):
            sp = greedy(MAX_NEW, **options)
            res = engine.generate(prompt, sp)
            assert res.token_ids == plain.generate(prompt, sp).token_ids, (name, i)
            accepted += sum(s.num_accepted for s in res.stats.steps)
    assert accepted > 0  # speculation was exercised (copying proposers accept little under repetition penalties)


@pytest.mark.parametrize("batched", [False, True])
def test_a_draft_equal_to_the_target_drafts_under_the_same_processors(model_sets, batched):
    """The draft model applies the request's processors along its chain as the verifier does at every row: a draft
    identical to the target is accepted whole at every step (one by one and through propose_batch)."""
    ms = model_sets("random")
    target = ms.runner("target", "fast")
    prop = make_proposer("draft_model", draft_runner=ms.runner("same", "fast"))
    if batched:  # every proposal through propose_batch (what the engine core calls)
        prop.propose = lambda state, budget: prop.propose_batch([state], [budget])[0]
    engine = engine_for(target, prop, 6, 6)
    for options in OPTIONS.values():
        for prompt in PROMPTS[:2]:
            res = engine.generate(prompt, greedy(MAX_NEW, **options))
            assert all(s.num_accepted == s.tree_depth for s in res.stats.steps), options


def test_batched_steps_process_each_request_with_its_own_options(model_sets):
    """On the engine core, requests with different options (and none) share forwards; each decodes as alone."""
    target = model_sets("cyclic").runner("target", "fast")
    plain = engine_for(target)
    jobs = [(prompt, greedy(MAX_NEW, **options)) for prompt in PROMPTS
            for options in [{}, *OPTIONS.values()]]
    for (prompt, sp), events in zip(jobs, batched_events(target, "prompt_lookup_tree", jobs), strict=True):
        assert [t for event in events for t in event.tokens] == plain.generate(prompt, sp).token_ids


# ---------------------------------------------------------------- sampling: the processed law
SAMPLES = 1500


@pytest.fixture(scope="module")
def e2e():
    from spec_helpers import make_runner, perturbed, tiny_llama

    target = tiny_llama(seed=5, vocab=E2E_VOCAB, hidden=32, heads=2, kv_heads=1, intermediate=64)
    return target, make_runner(target, "fast"), make_runner(perturbed(target, seed=6, rel_noise=0.5), "fast")


def processed_pair_law(model, prompt, sp: SamplingParams) -> dict[tuple, float]:
    """P(2nd, 3rd generated token) under plain sampling with the processors, marginalised over the 1st."""
    v = model.config.vocab_size

    @torch.no_grad()
    def probs(output):
        row = model(torch.tensor([prompt + output])).logits[0, -1].double().numpy()
        return ref_warp(ref_process(row, sp, prompt, output), sp.temperature, sp.top_k, sp.top_p)

    p1 = probs([])
    law = np.zeros((v, v))
    for a in range(v):
        p2 = probs([a])
        for b in range(v):
            law[b] += p1[a] * p2[b] * probs([a, b])
    return {(b, c): float(law[b, c]) for b in range(v) for c in range(v)}


@pytest.mark.parametrize("proposer,options", [
    ("draft_model_tree", dict(presence_penalty=1.5, frequency_penalty=0.7, logit_bias=((2, 1.5),))),
    ("fused", dict(repetition_penalty=2.0, top_k=5, top_p=0.9)),
], ids=["tree_penalties_bias", "fused_repetition_warped"])
def test_speculative_sampling_with_processors_has_the_processed_law(e2e, proposer, options):
    """On the engine core (``CORE_IN_FLIGHT`` requests in flight: the processors' per-row state in a batch, as
    `serve` runs it)."""
    from spec_helpers import results_on_core, window_for

    from drafter_service.drafter import LocalDrafter
    from drafter_service.proposer import make_proposer
    from orchestrator.drafter_link import only
    from orchestrator.policy import StaticPolicy
    from orchestrator.requests import Method
    from verifier_service.verifier import LocalVerifier

    model, target_runner, draft_runner = e2e
    prop = make_proposer(proposer, draft_runner=draft_runner)
    verifier = LocalVerifier(target_runner, feedback_topk=prop.feedback_topk, lookahead=window_for(prop))
    method = Method(only(LocalDrafter(prop), proposer), StaticPolicy(4, 2), strict=True)
    base = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, **options)
    jobs = [(E2E_PROMPT, SamplingParams(**{**base.__dict__, "seed": i})) for i in range(SAMPLES)]
    results = results_on_core(verifier, method, jobs)
    counts = Counter(tuple(res.token_ids[1:3]) for res in results)
    accepted = sum(s.num_accepted for res in results for s in res.stats.steps)
    steps = sum(res.stats.num_steps for res in results)
    assert accepted / steps > 0.05  # speculation was exercised
    law = processed_pair_law(model, E2E_PROMPT, base)
    assert chisquare_p(counts, law) > P_PASS
    plain_law = processed_pair_law(model, E2E_PROMPT, SamplingParams(temperature=1.0, top_k=base.top_k,
                                                                     top_p=base.top_p))
    # the processors changed the law, and the test sees it (a sample outside the plain law's support, or a bad fit)
    assert any(plain_law[c] == 0 for c in counts) or chisquare_p(counts, plain_law) < 1e-6
