"""Test helpers: tiny random Llama models, engine wiring, reference decoders, oracle proposers.

Everything here is built in code from fixed seeds, so the suite needs nothing outside
the repository. Models are float64 so that a tree forward and a sequential forward of
the same tokens can never disagree on an argmax.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import DraftSessionState, Proposer, make_proposer
from orchestrator.drafter_link import only
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh.blocks import BlockAllocator
from specmesh.contract import Budget
from specmesh.model_runner import ModelRunner
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.lookahead import LookaheadConfig
from verifier_service.verifier import LocalVerifier

VOCAB = 128
MAX_POSITIONS = 512
EOS = 2
BACKENDS = ("hf", "fast")


# ------------------------------------------------------------------ models
def tiny_llama(
    seed: int,
    vocab: int = VOCAB,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    layers: int = 2,
    init: float = 0.3,
    max_positions: int = MAX_POSITIONS,
) -> LlamaForCausalLM:
    """A random Llama in float64. A large ``init`` keeps the greedy output from collapsing."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@torch.no_grad()
def add_cycles(model: LlamaForCausalLM, seed: int, strength: float = 2.0, layer_scale: float = 0.02) -> LlamaForCausalLM:
    """Give the model a bigram backbone whose successor map has short cycles (3..8 tokens).

    Attention and MLP outputs are scaled down so the last token's embedding dominates
    the final hidden state, and the lm_head row of succ(x) is pushed towards x's
    embedding: greedy text then tends to loop (prompt lookup fires), while the context
    still changes roughly a quarter of the next-token argmaxes (attention matters).
    """
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    order = list(range(vocab))
    rng.shuffle(order)
    succ = [0] * vocab
    i = 0
    while i < vocab:
        cycle = order[i : i + min(rng.randrange(3, 9), vocab - i)]
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            succ[a] = b
        i += len(cycle)
    emb = model.model.embed_tokens.weight
    unit = emb / emb.norm(dim=1, keepdim=True)
    model.lm_head.weight[torch.tensor(succ)] += strength * unit
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(layer_scale)
        layer.mlp.down_proj.weight.mul_(layer_scale)
    return model


@torch.no_grad()
def perturbed(model: LlamaForCausalLM, seed: int, rel_noise: float) -> LlamaForCausalLM:
    """A copy of ``model`` with Gaussian noise (relative to each tensor's std) on every weight."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    for p in out.parameters():
        scale = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0
        p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * rel_noise * scale)
    return out.eval()


def make_runner(model: LlamaForCausalLM, backend: str) -> ModelRunner:
    if backend == "hf":
        return ModelRunner(model)
    if backend == "fast":
        from specmesh.fast_llama import FastLlamaRunner

        return FastLlamaRunner(model)
    raise ValueError(backend)


@dataclass
class ModelSet:
    """A target and three drafts of it: itself, a noisy copy (partial acceptance), an unrelated model."""

    target: LlamaForCausalLM
    near: LlamaForCausalLM
    other: LlamaForCausalLM
    _runners: dict = field(default_factory=dict)

    def runner(self, which: str, backend: str) -> ModelRunner:
        key = (which, backend)
        if key not in self._runners:
            # "same" is a separate runner object over the target's weights: draft == target
            model = {"target": self.target, "same": self.target, "near": self.near, "other": self.other}[which]
            self._runners[key] = make_runner(model, backend)
        return self._runners[key]


def build_model_set(kind: str) -> ModelSet:
    if kind == "random":
        target = tiny_llama(seed=11)
        near = perturbed(target, seed=12, rel_noise=0.35)
    elif kind == "cyclic":
        target = add_cycles(tiny_llama(seed=21), seed=22)
        near = perturbed(target, seed=23, rel_noise=0.3)
    else:
        raise ValueError(kind)
    other = tiny_llama(seed=99, hidden=32, intermediate=64)
    return ModelSet(target, near, other)


# ---------------------------------------------------------------- prompts
def make_prompts(num: int, seed: int, vocab: int = VOCAB, min_len: int = 5, max_len: int = 60) -> list[list[int]]:
    """Random prompts of varied lengths; every other one is a repeated pattern (prompt lookup fires)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        length = rng.randint(min_len, max_len)
        if i % 2:
            pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 7))]
            prompt = (pattern * (length // len(pattern) + 1))[:length]
            if length > 8:  # a little noise so the pattern is not perfectly periodic
                prompt[rng.randrange(length // 2)] = rng.randrange(vocab)
        else:
            prompt = [rng.randrange(vocab) for _ in range(length)]
        prompts.append(prompt)
    return prompts


# ------------------------------------------------------------------ engines
def engine_for(
    target_runner: ModelRunner,
    proposer: str | object | None = None,
    max_nodes: int = 8,
    max_depth: int = 8,
    draft_runner: ModelRunner | None = None,
    decode=None,
    verifier: LocalVerifier | None = None,
    strict: bool = True,
    **opts,
) -> Engine:
    """Wire an engine the way orchestrator/embedded.py does, without tokenizer files. ``strict`` (the default
    here): a drafter failure fails the request, so no drafter bug hides behind the fallback to plain
    decoding; tests of that fallback pass False."""
    drafters, topk, window = [], 0, None
    if proposer is not None:
        prop = make_proposer(proposer, draft_runner=draft_runner, **opts) if isinstance(proposer, str) else proposer
        drafters = only(LocalDrafter(prop), prop.name)
        topk = prop.feedback_topk
        window = window_for(prop)
    verifier = verifier if verifier is not None else LocalVerifier(target_runner, feedback_topk=topk, lookahead=window)
    return Engine(verifier, drafters, StaticPolicy(max_nodes, max_depth), decode, strict=strict)


def batched_events(target_runner: ModelRunner, proposer: str, jobs: Sequence[tuple[list[int], SamplingParams]],
                   max_nodes: int = 12, max_depth: int = 5) -> list[list]:
    """Every (prompt, sampling) job submitted at once to one EngineCore whose requests share one in-process drafter
    of ``proposer`` (a static budget, strict): each job's StepEvents that carry tokens. Asserts that the jobs shared
    forwards."""
    from orchestrator.requests import Method

    prop = make_proposer(proposer)
    method = Method(only(LocalDrafter(prop), prop.name), StaticPolicy(max_nodes, max_depth), strict=True)
    results = results_on_core(LocalVerifier(target_runner), method, jobs, in_flight=len(jobs))
    return [[event for event in result.events if event.tokens] for result in results]


# requests in flight in a distribution test on the core: 64 share each forward (the 23 core distribution tests
# took 95 s against 115 at 16; the batch's rows still differ in seed, tree and accepted length)
CORE_IN_FLIGHT = 64


def results_on_core(verifier: LocalVerifier, method, jobs: Sequence[tuple[list[int], SamplingParams]],
                    in_flight: int = CORE_IN_FLIGHT) -> list:
    """Each (prompt, sampling) job's GenerationResult, run on one EngineCore over ``verifier`` with ``method``
    (``orchestrator.requests.Method``), ``in_flight`` requests at a time: batched forwards, one drafter for all,
    as `serve` runs them (a distribution test's thousands of samples, in a fraction of one request at a time's
    time); each result's ``events`` are its StepEvents. Asserts that the requests shared forwards."""
    from orchestrator.core import EngineCore
    from orchestrator.requests import QueueOutput

    core = EngineCore(verifier)
    results = []
    try:
        for start in range(0, len(jobs), in_flight):
            outputs = []
            for prompt, sampling in jobs[start:start + in_flight]:
                outputs.append(QueueOutput())
                core.submit(prompt, sampling, method, outputs[-1])
            for output in outputs:
                events = list(output.events())  # drained: the request has finished
                output.result.events = events
                results.append(output.result)
        assert len(jobs) < 2 or core.stats.max_batch > 1
    finally:
        core.close()
    return results


def window_for(proposer: Proposer) -> LookaheadConfig | None:
    """The verifier window a proposer asks for (lookahead), as orchestrator/embedded.py configures it."""
    return LookaheadConfig(*proposer.feedback_window) if proposer.feedback_window is not None else None


def fragment(allocator: BlockAllocator, rng: random.Random) -> None:
    """Leave the pool's free blocks scattered: allocate everything in small tables, free every other one."""
    tables = []
    while allocator.num_free:
        tables.append(allocator.allocate(allocator.block_size * min(rng.randint(1, 3), allocator.num_free)))
    for table in tables[::2]:
        allocator.free(table)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


@torch.no_grad()
def naive_greedy(model: LlamaForCausalLM, prompt: Sequence[int], num_new: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence every step: no cache, no masks, no positions."""
    ids = list(prompt)
    out = []
    for _ in range(num_new):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
        out.append(tok)
    return out


@torch.no_grad()
def fresh_kv(runner: ModelRunner, tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values per layer ([num_kv_heads, len, head_dim]) of one causal prefill of ``tokens``."""
    cache = runner.new_cache()
    runner.forward(cache, list(tokens), range(len(tokens)))
    return [layer_kv(cache, i) for i in range(runner.model.config.num_hidden_layers)]


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_kv_heads, length, head_dim] keys/values of one layer."""
    return cache.layer_kv(layer)


def assert_cache_matches(cache, reference: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    length = reference[0][0].shape[1]
    assert cache.length == length, f"{what}: cache holds {cache.length} positions, expected {length}"
    for i, (ref_k, ref_v) in enumerate(reference):
        k, v = layer_kv(cache, i)
        assert k.shape == ref_k.shape, (what, i, k.shape, ref_k.shape)
        # float64 weights, but RMSNorm runs in float32 in both implementations: ~1e-7 relative noise
        where = f"{what}, layer {i}"
        torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w} keys: {m}")
        torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w} values: {m}")


class RecordingVerifier(LocalVerifier):
    """LocalVerifier that remembers every tree it verified and what it accepted (real contract kept)."""

    def __init__(self, runner: ModelRunner, **kw) -> None:
        super().__init__(runner, **kw)
        self.log: list[tuple[TokenTree, object]] = []

    def verify(self, session_id, tree):
        result = super().verify(session_id, tree)
        self.log.append((tree, result))
        return result


# --------------------------------------------------------------- proposers
@dataclass
class OracleProposer(Proposer):
    """Knows the target's greedy continuation of each prompt (test-only proposer, real contract).

    ``wrong=False``: a tree in which the true path is hidden behind ``decoys`` wrong siblings
    at every level (each with a one-node decoy subtree), so the accepted path is never a
    contiguous prefix of the node list and KV compaction has to gather. ``wrong=True``: a
    tree of the same shape in which no token is the target's: nothing may be accepted.
    """

    sequences: list[list[int]]  # prompt + greedy continuation
    vocab: int = VOCAB
    decoys: int = 2
    wrong: bool = False
    name: str = "oracle"

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        tokens = state.tokens
        seq = next(s for s in self.sequences if s[: len(tokens)] == tokens)
        truth = seq[len(tokens) : len(tokens) + budget.max_depth]
        rng = random.Random(len(tokens))
        toks: list[int] = []
        parents: list[int] = []

        def add(parent: int, tok: int) -> int | None:
            if len(toks) >= budget.max_nodes:
                return None
            toks.append(tok)
            parents.append(parent)
            return len(toks) - 1

        node = -1
        for depth, want in enumerate(truth):
            bad = [t for t in rng.sample(range(self.vocab), self.decoys + 2) if t != want][: self.decoys + 1]
            for d in bad[: self.decoys]:
                decoy = add(node, d)
                if decoy is not None and depth + 1 < len(truth):
                    add(decoy, rng.randrange(self.vocab))
            nxt = add(node, bad[-1] if self.wrong else want)
            if nxt is None:
                break
            node = nxt
        n = len(toks)
        return TokenTree(np.asarray(toks, np.int64), np.asarray(parents, np.int64), np.ones(n), (self.name,) * n)


def longest_matching_path(tree: TokenTree, truth: Sequence[int]) -> int:
    """Length of the longest root-to-node path of ``tree`` whose tokens are a prefix of ``truth``."""
    best = 0
    for i in range(tree.num_nodes):
        path = tree.path_to(i)
        if len(path) <= len(truth) and all(int(tree.tokens[n]) == truth[d] for d, n in enumerate(path)):
            best = max(best, len(path))
    return best


def check_greedy_steps(log, prompt: Sequence[int], generated: Sequence[int]) -> None:
    """Each verify step of one greedy request accepted exactly the longest tree path that follows the
    target's greedy continuation (``generated``: the AR output, long enough to cover every step)."""
    committed = len(prompt) + 1  # the prefill's first token
    for step, (tree, result) in enumerate(log):
        truth = list(generated[committed - len(prompt) :])
        for kids in tree.children:  # proposers must not waste nodes on duplicate siblings
            toks = [int(tree.tokens[k]) for k in kids]
            assert len(toks) == len(set(toks)), f"step {step}: duplicate sibling tokens {toks}"
        want = longest_matching_path(tree, truth)
        assert result.num_accepted == want, f"step {step}: accepted {result.num_accepted}, longest match {want}"
        assert list(result.tokens) == truth[: want + 1][: len(result.tokens)], f"step {step}"
        committed += len(result.tokens)


class ForwardingProposer(Proposer):
    """Forwards every hook and capability to ``inner`` (real contract); tests override what they watch."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.name = inner.name

    @property
    def feedback_topk(self) -> int:
        return self.inner.feedback_topk

    @property
    def feedback_min_ngram(self) -> int:
        return self.inner.feedback_min_ngram

    @property
    def feedback_window(self) -> tuple[int, int] | None:
        return self.inner.feedback_window

    def prepare(self, state: DraftSessionState) -> None:
        self.inner.prepare(state)

    def observe(self, state: DraftSessionState, feedback) -> None:
        self.inner.observe(state, feedback)

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        return self.inner.propose(state, budget)

    def release(self, state: DraftSessionState) -> None:
        self.inner.release(state)


class ContextRecorder(ForwardingProposer):
    """Wraps a proposer and records the context (committed tokens) it is asked to continue.

    ``whole_budgets``: every tree is drafted to its budget, the pre-draft's stop event and any deadline
    ignored, so which drafted-ahead trees get used depends on the drafts alone and not on whether the
    drafter thread got a core before the verification ended (a loaded machine otherwise stops every
    pre-draft before its first new level)."""

    def __init__(self, inner: Proposer, whole_budgets: bool = False) -> None:
        super().__init__(inner)
        self.contexts: list[list[int]] = []
        self.whole_budgets = whole_budgets

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        self.contexts.append(list(state.tokens))
        if self.whole_budgets:
            budget = replace(budget, deadline=None, stop=None)
        return self.inner.propose(state, budget)


def check_drafter_contexts(contexts: list[list[int]], log, prompt: Sequence[int], generated: Sequence[int]) -> None:
    """The drafter always saw exactly the committed tokens: prompt + everything verified so far."""
    full = list(prompt) + list(generated)
    lengths = [len(prompt) + 1]
    for _, result in log:
        lengths.append(lengths[-1] + len(result.tokens))
    assert len(contexts) >= sum(1 for tree, _ in log if tree.num_nodes)
    for ctx in contexts:
        assert ctx == full[: len(ctx)], "drafter context is not the committed sequence"
        assert len(ctx) in lengths, f"drafter saw {len(ctx)} tokens; committed lengths were {lengths}"


def drafter_of(engine: Engine) -> LocalDrafter | None:
    """The drafter of an engine wired with one (``engine_for``), for checks of its sessions."""
    return engine.drafters[0][1]() if engine.drafters else None
