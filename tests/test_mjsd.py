"""MJSD (proposer ``mjsd``): beam drafting, joint-likelihood acceptance, and the opt-in that guards it.

MJSD is lossy by design, so its invariants are its own: the beam is the draft's best joint-q sequence (brute
force on a tiny vocabulary) with exact conditional q per token; the verifier accepts exactly the longest
prefix whose joint ratio p/q reaches the threshold, then the target's argmax; a threshold nothing reaches
gives autoregressive greedy output; draft = target accepts every drafted token. And nothing reaches the lossy
acceptance without naming the proposer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from spec_helpers import BACKENDS, engine_for, greedy, make_prompts, naive_greedy, tiny_llama

from drafter_service.fusion import fused_proposer, parse_members
from drafter_service.mjsd import MJSDProposer, beam_search, mjsd_proposer
from drafter_service.proposer import DraftSessionState, proposer_names, proposer_spec
from orchestrator.acceptance import acceptance_of, request_sampling
from specmesh.contract import Budget
from specmesh.sampling import DEFAULT_MJSD_THRESHOLD, SamplingParams
from specmesh.tree import TokenTree
from specmesh.v1 import common_pb2
from specmesh.wire import sampling_from_proto, sampling_to_proto
from verifier_service.verification import node_logprobs, verify_mjsd

SMALL_VOCAB = 6
PROMPTS = make_prompts(4, seed=5, vocab=SMALL_VOCAB, max_len=20)
MJSD = SamplingParams(acceptance="mjsd")


@pytest.fixture(scope="module")
def small_draft():
    """A tiny random draft over a 6-token vocabulary: every sequence of 3 can be enumerated."""
    return tiny_llama(seed=3, vocab=SMALL_VOCAB, hidden=32, intermediate=64)


@torch.no_grad()
def log_q(model, tokens: list[int]) -> torch.Tensor:
    """The draft's full-softmax log q after ``tokens``, by a full forward (no cache, no masks). [vocab]"""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)


def brute_force_best(model, prompt: list[int], length: int) -> tuple[list[int], float]:
    """The sequence of ``length`` tokens with the highest joint q, by enumeration."""
    best, best_score = None, -math.inf
    for seq in itertools.product(range(SMALL_VOCAB), repeat=length):
        score = sum(float(log_q(model, prompt + list(seq[:i]))[seq[i]]) for i in range(length))
        if score > best_score:
            best, best_score = list(seq), score
    return best, best_score


def reference_beam(model, prompt: list[int], width: int, length: int) -> list[int]:
    """Beam search as the module documents it, every conditional by a full forward."""
    beams = [([], 0.0)]
    for _ in range(length):
        cands = [(seq + [t], score + float(lq[t])) for seq, score in beams
                 for lq in [log_q(model, prompt + seq)] for t in range(SMALL_VOCAB)]
        beams = sorted(cands, key=lambda c: -c[1])[:width]
    return beams[0][0]


def _state(prompt) -> DraftSessionState:
    return DraftSessionState("s", list(prompt), SamplingParams())


# ------------------------------------------------------------------ drafting
@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_beam_is_the_top_joint_q_sequence_with_exact_conditionals(small_draft, backend):
    from spec_helpers import make_runner

    prop = MJSDProposer(make_runner(small_draft, backend), beam_width=SMALL_VOCAB ** 2)  # exhaustive for 3 tokens
    for prompt in PROMPTS[:3]:
        state = _state(prompt)
        tree = prop.propose(state, Budget(3, 3))
        want, score = brute_force_best(small_draft, list(prompt), 3)
        assert tree.tokens.tolist() == want and tree.parents.tolist() == [-1, 0, 1]
        assert tree.sources == ("mjsd",) * 3
        # draft_probs: q(x_i | context, x_<i) of the draft's full softmax, not renormalised over the beam
        for i in range(3):
            q = math.exp(float(log_q(small_draft, list(prompt) + want[:i])[want[i]]))
            assert tree.draft_probs[i] == pytest.approx(q, rel=1e-6)
        assert float(np.log(tree.draft_probs).sum()) == pytest.approx(score, rel=1e-6)
        dc = state.scratch["mjsd"]  # the beams left the draft cache
        assert dc.cached == list(prompt) and dc.cache.length == len(prompt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 2, 3])
def test_narrow_beam_prunes_as_plain_beam_search(small_draft, backend, width):
    """Pruned beams stay in the draft cache under the tree mask: the survivors must still see only their own
    tokens, so the cached search equals beam search by full forwards."""
    from spec_helpers import make_runner

    prop = MJSDProposer(make_runner(small_draft, backend), beam_width=width)
    for prompt in PROMPTS:
        tree = prop.propose(_state(prompt), Budget(4, 4))
        assert tree.tokens.tolist() == reference_beam(small_draft, list(prompt), width, 4)


def test_beam_length_options_budget_and_cache_reuse(model_sets):
    ms = model_sets("random")
    runner = ms.runner("near", "fast")
    prop = mjsd_proposer(runner, beam_width=4, draft_length=3)
    state = _state([5, 6, 7, 8])
    assert prop.propose(state, Budget(8, 8)).num_nodes == 3  # draft_length caps
    assert prop.propose(state, Budget(8, 2)).num_nodes == 2  # ... and so does the budget
    assert prop.propose(state, Budget(0, 0)).num_nodes == 0
    assert mjsd_proposer(runner).propose(state, Budget(4, 4)).num_nodes == 4  # default: the budget's depth
    # a partial acceptance + bonus committed: the reused cache proposes what a fresh proposer does
    tree = prop.propose(state, Budget(8, 8))
    state.tokens += [int(tree.tokens[0]), 9]
    again = prop.propose(state, Budget(8, 8))
    fresh = mjsd_proposer(runner, beam_width=4, draft_length=3).propose(_state(state.tokens), Budget(8, 8))
    assert again.tokens.tolist() == fresh.tokens.tolist()
    np.testing.assert_allclose(again.draft_probs, fresh.draft_probs, rtol=1e-6)
    with pytest.raises(ValueError, match="no option"):
        mjsd_proposer(runner, threshold=0.3)  # the verifier's, not the drafter's
    with pytest.raises(ValueError, match="beam_width"):
        mjsd_proposer(runner, beam_width=0)


def test_beam_search_stops_when_expired():
    calls = []

    def step(parents, tokens, depth):
        calls.append(depth)
        return torch.zeros(len(tokens), 4)

    tokens, lq = beam_search(step, torch.tensor([0.0, 3.0, 1.0, 0.0]), 2, 5, expired=lambda: len(calls) >= 2)
    assert len(tokens) == 3 and tokens[0] == 1 and calls == [1, 2]
    assert lq[1] == pytest.approx(math.log(0.25))


# ------------------------------------------------------------------ verification
def _chain(tokens, q) -> TokenTree:
    return TokenTree.chain(tokens, q, "mjsd")


def test_verify_mjsd_accepts_the_longest_prefix_over_the_threshold():
    tree = _chain([10, 11, 12, 13], [0.5, 0.5, 0.5, 0.5])
    argmax = np.array([20, 21, 22, 23, 24])
    # ratios p/q 0.6, 2, 0.5, 2 -> joint 0.6, 1.2, 0.6, 1.2: not monotone; the first token alone fails 1.0
    logp = np.log([0.3, 1.0, 0.25, 1.0])
    acc = verify_mjsd(tree, argmax, logp, 1.0)
    assert acc.accepted_nodes == (0, 1, 2, 3) and acc.bonus_token == 24  # the longest passing prefix, past a dip
    assert verify_mjsd(tree, argmax, logp, 0.5).accepted_nodes == (0, 1, 2, 3)
    acc = verify_mjsd(tree, argmax, np.log([0.3, 1.0, 0.25, 0.1]), 1.0)  # joint 0.6, 1.2, 0.6, 0.12
    assert acc.accepted_nodes == (0, 1) and acc.bonus_token == 22 and acc.tokens(tree) == [10, 11, 22]
    acc = verify_mjsd(tree, argmax, logp, 1.3)  # nothing reaches 1.3: the target's own token
    assert acc.accepted_nodes == () and acc.bonus_token == 20
    # p = 0 never passes (and never NaN), q = 0 gives a huge ratio, not NaN
    assert verify_mjsd(tree, argmax, np.array([-np.inf, 0.0, 0.0, 0.0]), 1e-9).accepted_nodes == ()
    zero_q = _chain([10], [0.0])
    assert verify_mjsd(zero_q, argmax[:2], np.log([0.5]), 1.0).accepted_nodes == (0,)
    assert verify_mjsd(TokenTree.empty(), argmax[:1], np.zeros(0), 1.0).bonus_token == 20
    with pytest.raises(ValueError, match="threshold"):
        verify_mjsd(tree, argmax, logp, 0.0)


def test_verify_mjsd_on_a_tree_takes_the_longest_accepted_path_prefix():
    # two paths from the root: 0 -> 1 -> 2 and 3 -> 4 -> 5 -> 6
    tree = TokenTree(np.array([1, 2, 3, 4, 5, 6, 7]), np.array([-1, 0, 1, -1, 3, 4, 5]), np.full(7, 0.5),
                     ("mjsd",) * 7)
    argmax = np.arange(100, 108)
    logp = np.log([0.5, 0.5, 0.1, 0.1, 0.5, 1.0, 0.05])  # joint ratios: 1, 1, 0.2 | 0.2, 0.2, 0.4, 0.04
    acc = verify_mjsd(tree, argmax, logp, 0.3)  # passing: 0, 1 and 5; the deepest is 5, on the second path
    assert acc.accepted_nodes == (3, 4, 5) and acc.bonus_token == 106
    acc = verify_mjsd(tree, argmax, logp, 0.5)
    assert acc.accepted_nodes == (0, 1) and acc.bonus_token == 102


def test_node_logprobs_reads_each_token_from_its_parents_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 7, generator=gen)
    trees = [_chain([1, 2, 3], [1.0] * 3), TokenTree(np.array([4, 5, 6]), np.array([-1, -1, 0]), np.ones(3), ())]
    got = node_logprobs(trees, logits, [0, 4])
    full = torch.log_softmax(logits.double(), -1).numpy()  # computed in float32 on the device
    np.testing.assert_allclose(got[0], [full[0, 1], full[1, 2], full[2, 3]], rtol=1e-6)
    np.testing.assert_allclose(got[1], [full[4, 4], full[4, 5], full[5, 6]], rtol=1e-6)
    assert [len(x) for x in node_logprobs([TokenTree.empty()], logits, [0])] == [0]


# ------------------------------------------------------------------ end to end (embedded)
def _mjsd_engine(ms, draft: str, threshold: float, max_depth: int = 4, overlap: bool = False):
    engine = engine_for(ms.runner("target", "fast"), "mjsd", max_nodes=max_depth, max_depth=max_depth,
                        draft_runner=ms.runner(draft, "fast"))
    engine.overlap = overlap
    return engine, greedy(24, acceptance="mjsd", mjsd_threshold=threshold)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_unreachable_threshold_gives_autoregressive_greedy_output(model_sets, overlap):
    ms = model_sets("random")
    engine, sampling = _mjsd_engine(ms, "near", threshold=1e300, overlap=overlap)
    for prompt in make_prompts(3, seed=8):
        result = engine.generate(prompt, sampling)
        assert result.token_ids == naive_greedy(ms.target, prompt, 24)
        assert all(s.num_accepted == 0 for s in result.stats.steps)
        assert result.stats.acceptance == "mjsd" and result.stats.lossy and result.stats.summary()["lossy"]


def test_draft_equal_to_target_accepts_every_drafted_token(model_sets):
    ms = model_sets("random")
    engine, sampling = _mjsd_engine(ms, "same", threshold=0.5)
    for prompt in make_prompts(3, seed=9):
        result = engine.generate(prompt, sampling)
        steps = result.stats.steps
        assert all(s.num_accepted == s.num_proposed for s in steps)
        assert all(s.num_proposed == 4 for s in steps[:-2])  # the last steps are clipped to max_new_tokens
        assert len(result.token_ids) == 24


def test_mjsd_output_is_reproducible_and_lossy_only_when_asked(model_sets):
    ms = model_sets("random")
    engine, sampling = _mjsd_engine(ms, "near", threshold=DEFAULT_MJSD_THRESHOLD)
    prompt = make_prompts(1, seed=10)[0]
    first = engine.generate(prompt, sampling).token_ids
    assert engine.generate(prompt, sampling).token_ids == first
    # the same beam drafter under exact acceptance is lossless
    exact = engine.generate(prompt, greedy(24))
    assert exact.token_ids == naive_greedy(ms.target, prompt, 24) and not exact.stats.lossy


# ------------------------------------------------------------------ the opt-in
def test_sampling_params_validate_the_acceptance():
    assert SamplingParams().acceptance == "exact" and not SamplingParams().lossy
    assert MJSD.lossy and MJSD.mjsd_threshold == DEFAULT_MJSD_THRESHOLD
    with pytest.raises(ValueError, match="greedy only"):
        SamplingParams(temperature=0.7, acceptance="mjsd")
    with pytest.raises(ValueError, match="acceptance"):
        SamplingParams(acceptance="approximate")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="mjsd_threshold"):
            SamplingParams(acceptance="mjsd", mjsd_threshold=bad)


def test_only_the_mjsd_proposer_gets_the_lossy_acceptance():
    assert [n for n in proposer_names() if proposer_spec(n).lossy] == ["mjsd"]
    assert "LOSSY" in proposer_spec("mjsd").help
    for name in [*proposer_names(), None, "none"]:
        asked = request_sampling(name, SamplingParams())
        assert asked.acceptance == acceptance_of(name) == ("mjsd" if name == "mjsd" else "exact")
    assert request_sampling("mjsd", SamplingParams(), 0.7).mjsd_threshold == 0.7
    with pytest.raises(ValueError, match="greedy only"):
        request_sampling("mjsd", SamplingParams(temperature=0.8))
    with pytest.raises(ValueError, match="comes only with"):
        request_sampling("fused", MJSD)  # asked for the acceptance without its proposer
    with pytest.raises(ValueError, match="mjsd proposer only"):
        request_sampling("draft_model", SamplingParams(), 0.5)


def test_fused_refuses_a_lossy_member(model_sets):
    with pytest.raises(ValueError, match="cannot include mjsd"):
        parse_members("copy+mjsd")
    with pytest.raises(ValueError, match="cannot include mjsd"):
        fused_proposer("draft_model+mjsd", draft_runner=model_sets("random").runner("near", "fast"))


def test_policies_and_defaults_never_choose_mjsd():
    from drafter_service.proposer import DEFAULT_PROPOSER
    from orchestrator.server import add_arguments
    from specmesh_app.bench import default_methods

    assert not proposer_spec(DEFAULT_PROPOSER).lossy
    assert "mjsd" not in default_methods(has_draft=True)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    serve_proposer = next(a for a in parser._actions if a.dest == "proposer")
    assert "mjsd" not in serve_proposer.choices  # `serve --proposer` is the default for requests naming none


def test_the_serving_path_sets_mjsd_only_for_its_proposer(demo_stack):
    from orchestrator.embedded import EmbeddedBackend
    from orchestrator.service import GenerateRequest, GenerationService

    service = GenerationService(EmbeddedBackend(demo_stack), demo_stack.tokenizer, "demo")
    plan = service.plan(GenerateRequest(SamplingParams(max_new_tokens=8), prompt="def f(x):", proposer="mjsd"))
    assert plan.sampling.acceptance == "mjsd" and plan.max_depth == 4
    for proposer in (None, "fused", "draft_model", "none"):
        plan = service.plan(GenerateRequest(SamplingParams(max_new_tokens=8), prompt="x", proposer=proposer))
        assert plan.sampling.acceptance == "exact", proposer
    with pytest.raises(ValueError, match="greedy only"):
        service.plan(GenerateRequest(SamplingParams(temperature=1.0), prompt="x", proposer="mjsd"))
    with pytest.raises(ValueError, match="comes only with"):
        service.plan(GenerateRequest(MJSD, prompt="x", proposer="copy"))
    with pytest.raises(ValueError, match="lossy"):
        GenerationService(EmbeddedBackend(demo_stack), demo_stack.tokenizer, "demo", default_proposer="mjsd")


def test_wire_round_trip_of_the_acceptance():
    for params in (SamplingParams(), dataclasses.replace(MJSD, mjsd_threshold=0.125, max_new_tokens=7)):
        msg = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
        assert sampling_from_proto(msg) == params
    empty = sampling_from_proto(common_pb2.SamplingParams())  # an older client: exact, default threshold
    assert empty.acceptance == "exact" and empty.mjsd_threshold == DEFAULT_MJSD_THRESHOLD
    with pytest.raises(ValueError, match="greedy only"):
        sampling_from_proto(common_pb2.SamplingParams(temperature=0.5, acceptance="mjsd"))


# ------------------------------------------------------------------ over gRPC
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_mjsd_over_grpc_equals_in_process(mesh, demo_stack, overlap):
    from specmesh.client import Client

    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n"]
    with Client(mesh["serve"].address, timeout=120) as client:
        for prompt in prompts:
            remote = client.generate(prompt, max_new_tokens=32, proposer="mjsd", overlap=overlap, mjsd_threshold=0.2)
            sampling = request_sampling("mjsd", SamplingParams(max_new_tokens=32), 0.2)
            local = demo_stack.engine("mjsd", overlap=overlap).generate(demo_stack.tokenizer.encode(prompt), sampling)
            assert remote.token_ids == local.token_ids, prompt
            assert remote.stats["lossy"] and remote.stats["acceptance"] == "mjsd"
            assert remote.stats["draft_errors"] == 0
        plain = client.generate(prompts[0], max_new_tokens=8, proposer="draft_model")
        assert not plain.stats["lossy"] and plain.stats["acceptance"] == "exact"
        import grpc

        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompts[0], max_new_tokens=8, proposer="mjsd", temperature=0.7)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "greedy only" in err.value.details()
