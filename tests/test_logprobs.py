"""Token log-probabilities (``SamplingParams.logprobs``, OpenAI's ``logprobs`` / ``top_logprobs``).

Every committed token (accepted path and bonus, and the prefill's first) carries its log-probability under the
distribution it was decoded from: the target's at verification, after the logit processors and warping (greedy:
the processed logits' softmax). Checked against a naive reference that recomputes the whole sequence with the HF
model, for plain decoding and every proposer, greedy and sampled, alone and batched on the engine core.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_helpers import batched_events, engine_for, greedy, make_prompts
from test_logits_process import ref_process
from test_sampling_distribution import ref_warp

from drafter_service.proposer import proposer_names
from specmesh.contract import TokenLogprobs
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2
from specmesh.wire import logprobs_from_proto, logprobs_to_proto

MAX_NEW = 20
K = 3
PROMPTS = make_prompts(3, seed=11)


def result_logprobs(result) -> TokenLogprobs:
    """The log-probabilities of a GenerationResult's events, joined."""
    events = [e for e in result.events if e.tokens]
    assert all(e.logprobs is not None and e.logprobs.token_ids == e.tokens for e in events)
    return TokenLogprobs.join(e.logprobs for e in events)


@torch.no_grad()
def reference_logprobs(model, prompt, tokens, sp: SamplingParams) -> np.ndarray:
    """[len(tokens), vocab]: the log of the distribution each token was decoded from (processed, then warped, or
    the softmax when greedy), recomputing the whole sequence."""
    rows = []
    for j in range(len(tokens)):
        logits = model(torch.tensor([list(prompt) + list(tokens[:j])])).logits[0, -1].double().numpy()
        x = ref_process(logits, sp, prompt, tokens[:j])
        if sp.greedy:
            rows.append(x - np.logaddexp.reduce(x))
        else:
            with np.errstate(divide="ignore"):
                rows.append(np.log(ref_warp(x, sp.temperature, sp.top_k, sp.top_p)))
    return np.stack(rows)


def check_against_reference(lp: TokenLogprobs, tokens, model, prompt, sp: SamplingParams, k: int) -> None:
    assert lp.token_ids == tuple(tokens)
    ref = reference_logprobs(model, prompt, tokens, sp)
    got = np.asarray(lp.logprobs)
    want = ref[np.arange(len(tokens)), tokens]
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert np.all(np.isfinite(got))  # a decoded token is inside the distribution's support
    assert all(len(ids) == k for ids in lp.top_ids)
    for j, (ids, values) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True)):
        np.testing.assert_allclose(values, ref[j][list(ids)], atol=2e-4)
        finite = np.isfinite(values)
        assert list(values) == sorted(values, reverse=True)  # most likely first
        # the top ids are the reference's k largest (ties aside): their values match its sorted top k
        np.testing.assert_allclose(np.asarray(values)[finite], np.sort(ref[j])[::-1][:k][finite], atol=2e-4)
        if sp.greedy:
            assert ids[0] == tokens[j]  # greedy picks the most likely


def test_wire_round_trip_and_malformed():
    lp = TokenLogprobs((5, 7), (-0.5, -1.25), ((5, 2), (7, 1)), ((-0.5, -2.0), (-1.25, -1.5)))
    assert logprobs_from_proto(common_pb2.TokenLogprobs.FromString(logprobs_to_proto(lp).SerializeToString())) == lp
    assert lp.head(1).token_ids == (5,) and len(lp.head(1)) == 1
    assert (lp.head(1) + TokenLogprobs((7,), (-1.25,), ((7, 1),), ((-1.25, -1.5),))) == lp
    with pytest.raises(ValueError, match="logprobs"):
        logprobs_from_proto(common_pb2.TokenLogprobs(token_ids=[1], logprobs=[-1.0], k=2, top_ids=[1]))
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_plain_decoding_logprobs_match_the_reference(model_sets, backend):
    ms = model_sets("random")
    engine = engine_for(ms.runner("target", backend))
    for prompt in PROMPTS:
        sp = greedy(MAX_NEW, logprobs=K)
        res = engine.generate(prompt, sp)
        check_against_reference(result_logprobs(res), res.token_ids, ms.target, prompt, sp, K)
    # none asked: none computed
    res = engine.generate(PROMPTS[0], greedy(4))
    assert all(e.logprobs is None for e in res.events)


@pytest.mark.parametrize("proposer", proposer_names())
def test_speculative_logprobs_equal_plain_decoding(model_sets, proposer):
    """Greedy, with and without processors: the same tokens and the same numbers as plain decoding, for the
    accepted tokens and the bonus token alike."""
    kind = "random" if proposer.startswith("draft_model") else "cyclic"
    ms = model_sets(kind)
    target = ms.runner("target", "fast")
    # a draft model equal to the target: every drafted token accepted (the others see rejections too)
    engine = engine_for(target, proposer, 12, 5, draft_runner=ms.runner("same", "fast"))
    plain = engine_for(target)
    accepted = 0
    for options in ({}, {"presence_penalty": 0.5, "repetition_penalty": 1.2}):
        for prompt in PROMPTS:
            sp = greedy(MAX_NEW, logprobs=K, **options)
            res, ref = engine.generate(prompt, sp), plain.generate(prompt, sp)
            assert res.token_ids == ref.token_ids
            got, want = result_logprobs(res), result_logprobs(ref)
            assert got.token_ids == want.token_ids and got.top_ids == want.top_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
            np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, atol=1e-4)
            accepted += sum(s.num_accepted for s in res.stats.steps)
    assert accepted > 0 or proposer == "jacobi"  # Jacobi's guesses are rarely right on these few prompts
    check_against_reference(got, res.token_ids, ms.target, PROMPTS[-1], sp, K)


@pytest.mark.parametrize("proposer,options", [
    ("draft_model_tree", dict(temperature=1.0)),
    ("draft_model", dict(temperature=0.7, top_p=0.9)),
    ("fused", dict(temperature=0.8, top_k=6, frequency_penalty=0.5, logit_bias=((3, 2.0),))),
])
def test_sampled_logprobs_are_those_of_the_warped_distribution(model_sets, proposer, options):
    ms = model_sets("random")
    engine = engine_for(ms.runner("target", "fast"), proposer, 8, 4, draft_runner=ms.runner("near", "fast"))
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, seed=i, logprobs=2, **options)
        res = engine.generate(prompt, sp)
        check_against_reference(result_logprobs(res), res.token_ids, ms.target, prompt, sp, 2)


def test_a_stop_inside_a_step_cuts_the_logprobs_with_the_tokens(model_sets):
    ms = model_sets("cyclic")
    target = ms.runner("target", "fast")
    engine = engine_for(target, "prompt_lookup", 12, 8)
    full = engine.generate(PROMPTS[0], greedy(MAX_NEW))
    stop = full.token_ids[7]
    res = engine.generate(PROMPTS[0], greedy(MAX_NEW, logprobs=0, stop_token_ids=(stop,)))
    lp = result_logprobs(res)
    assert lp.token_ids == tuple(res.token_ids) and res.token_ids[-1] == stop
    assert all(ids == () for ids in lp.top_ids)  # logprobs=0: the tokens' own only


def test_batched_requests_get_their_own_logprobs(model_sets):
    target = model_sets("cyclic").runner("target", "fast")
    plain = engine_for(target)
    jobs = [(p, greedy(MAX_NEW, **o)) for p in PROMPTS for o in ({}, {"logprobs": 2}, {"logprobs": 5})]
    for (prompt, sp), events in zip(jobs, batched_events(target, "prompt_lookup_tree", jobs), strict=True):
        ref = plain.generate(prompt, sp)
        assert [t for e in events for t in e.tokens] == ref.token_ids
        if sp.logprobs is None:
            assert all(e.logprobs is None for e in events)
            continue
        assert all(e.logprobs is not None for e in events)
        got, want = TokenLogprobs.join(e.logprobs for e in events), result_logprobs(ref)
        assert got.token_ids == want.token_ids and got.top_ids == want.top_ids
        assert all(len(ids) == sp.logprobs for ids in got.top_ids)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
