"""The generic Hugging Face runner on the paged KV pool (specmesh/model_runner.py: ``paged_shape``, ``new_pool``,
the ``Cache`` adapter).

Models whose attention caches are one shape per layer get a ``KVPool`` like the fast runner's; their sessions'
keys/values are written into and read from the pool's slots through transformers' own ``Cache`` interface. Held
here against a full recompute without any cache, on three architectures, over fragmented pools (tables that are
no run of blocks: the gather path), chunked prefill, tree steps with compaction and shared prefix blocks; a model
with a sliding window is refused.
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import engine_for, greedy, make_prompts, naive_greedy, tiny_llama

from specmesh.kv_pool import compact
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.tree import ancestor_mask
from verifier_service.verifier import LocalVerifier


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=256,
                                      bos_token_id=0, eos_token_id=1)).double().eval()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256)).double().eval()


MODELS = {"llama": lambda: tiny_llama(seed=11), "gpt2": _gpt2, "qwen2": _qwen2}


@torch.no_grad()
def full(model, tokens) -> torch.Tensor:
    """Logits of every position of ``tokens`` without a cache: [len, vocab]."""
    return model(torch.tensor([list(tokens)])).logits[0].double()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_paged_forward_equals_a_full_recompute(arch):
    """Chunked prefill, a tree step, compaction to one path and decoding after it, on a fragmented pool: every
    logit row equals the row of a forward over the whole sequence without a cache."""
    model = MODELS[arch]()
    runner = ModelRunner(model)
    assert runner.paged_shape is not None
    pool = runner.new_pool(40, 4)
    singles = [pool.allocator.allocate(4) for _ in range(40)]
    for table in singles[::2]:  # every other block free: no two of a session's blocks are neighbours
        pool.allocator.free(table)
    cache = pool.open(0)
    prompt = make_prompts(1, seed=5, vocab=128, min_len=30, max_len=30)[0]
    logits = torch.cat([runner.forward(cache, prompt[a:b], range(a, b)) for a, b in ((0, 13), (13, 30))])
    torch.testing.assert_close(logits.double(), full(model, prompt), rtol=1e-6, atol=1e-6)
    assert len(cache.table) == 8 and cache.base is None  # scattered blocks: read through a gather

    # a tree of two branches after the prompt: 0 -> 1 -> 2, 0 -> 3
    tree_tokens, parents = [7, 8, 9, 10], [-1, 0, 1, 0]
    attend = TreeMask(len(prompt), torch.from_numpy(ancestor_mask(parents)))
    step = runner.forward(cache, tree_tokens, [30, 31, 32, 31], attend).double()
    for node, path in ((2, [7, 8, 9]), (3, [7, 10])):
        torch.testing.assert_close(step[node], full(model, prompt + path)[-1], rtol=1e-6, atol=1e-6)
    compact([cache], [len(prompt)], [[0, 3]])  # keep the path 7, 10
    cache.trim()
    seq = prompt + [7, 10]
    for _ in range(5):
        x = int(full(model, seq)[-1].argmax())
        row = runner.forward(cache, [x], [len(seq)])[0].double()
        seq.append(x)
        torch.testing.assert_close(row, full(model, seq)[-1], rtol=1e-6, atol=1e-6)
    assert cache.length == len(seq)
    cache.free()


def test_shared_prefix_blocks_are_read_not_written():
    """Two sessions whose tables start with the same full blocks (the prefix cache's sharing): the second
    writes only its own positions, the shared blocks' keys stay as the first wrote them."""
    model = tiny_llama(seed=11)
    runner = ModelRunner(model)
    pool = runner.new_pool(16, 4)
    prompt = list(range(3, 15))  # three full blocks
    first = pool.open(0)
    runner.forward(first, prompt, range(12))
    shared = list(first.table[:3])
    before = pool.keys[:, :, shared[0] * 4 : (shared[-1] + 1) * 4].clone()
    second = pool.open(12, shared)  # holds the shared blocks, their 12 positions counted
    out = runner.forward(second, [20, 21], [12, 13])
    torch.testing.assert_close(out.double(), full(model, prompt + [20, 21])[-2:], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool.keys[:, :, shared[0] * 4 : (shared[-1] + 1) * 4], before)
    assert second.table[:3] == shared and len(second.table) == 4


def test_a_sliding_window_model_is_refused():
    """A model whose caches do not fit a paged pool (a sliding window: transformers' sliding layers drop the
    oldest keys) is refused when its runner is built, with the reason, by the generic runner and by ``make_runner``
    (the fast runner refuses sliding windows first)."""
    from transformers import MistralConfig, MistralForCausalLM

    from specmesh.fast_llama import make_runner

    torch.manual_seed(5)
    model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=16)).eval()
    for build in (ModelRunner, make_runner):
        with pytest.raises(ValueError, match="MistralForCausalLM is not supported: its attention caches "
                                             r"\(DynamicSlidingWindowLayer"):
            build(model)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("proposer", ["prompt_lookup_tree", "draft_model"])
def test_greedy_equals_ar_through_the_paged_hf_verifier(arch, proposer):
    """Speculative greedy decoding on another architecture than Llama, its verifier on the paged pool (the
    draft model, the target itself, on the draft pool): the output is the model's own greedy continuation."""
    model = MODELS[arch]()
    target = ModelRunner(model)
    verifier = LocalVerifier(target, kv_cache_gb=0.01)
    assert verifier.prefix_caching
    engine = engine_for(target, proposer, 8, 4, draft_runner=ModelRunner(model), verifier=verifier)
    for prompt in make_prompts(3, seed=9, vocab=128, min_len=10, max_len=40):
        result = engine.generate(prompt, greedy(16))
        assert result.token_ids == naive_greedy(model, prompt, 16)
        if proposer == "draft_model":  # the target drafting for itself: every drafted token is accepted
            assert result.stats.tau > 1
    assert verifier.allocator.num_used == 0
