"""The fast Llama-family runner computes the same logits as the Hugging Face forward."""

from __future__ import annotations

import logging
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specmesh import cpu_platform, sdpa_attention
from specmesh.cpu_platform import blocked_product, head_blocks
from specmesh.cuda_graphs import relative_error
from specmesh.fast_llama import (
    FastLlamaRunner,
    _post_attention,
    _pre_attention,
    compile_choice,
    make_runner,
    supports,
)
from specmesh.model_runner import ModelRunner, tree_attend_mask
from specmesh.runner_options import COMPILE_ENV, cpu_flags


def _llama(num_kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=num_kv_heads == 4)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.3)
            layer.self_attn.k_proj.bias.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("model", [_llama(4), _llama(2), _qwen2()], ids=["mha-tied", "gqa", "qwen2-bias"])
def test_fast_runner_matches_hf(model) -> None:
    assert supports(model) is None
    hf, fast = ModelRunner(model), FastLlamaRunner(model)
    c_hf, c_fast = hf.new_cache(), fast.new_cache()
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(fast.forward(c_fast, prompt, range(40)), hf.forward(c_hf, prompt, range(40)),
                               rtol=1e-10, atol=1e-10)
    # a tree step: root children 0 and 2, node 1 under 0, node 3 under 2
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    attend = tree_attend_mask(40, ancestors)
    ids, pos = [5, 6, 7, 8], [40, 41, 40, 41]
    torch.testing.assert_close(fast.forward(c_fast, ids, pos, attend), hf.forward(c_hf, ids, pos, attend),
                               rtol=1e-10, atol=1e-10)
    # keep the path 2 -> 3, then continue: the compacted caches must agree
    c_hf.keep(40, [2, 3])
    c_fast.keep(40, [2, 3])
    for layer in range(2):
        for a, b in zip(c_fast.layer_kv(layer), c_hf.layer_kv(layer), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast.forward(c_fast, [9, 10], [42, 43]), hf.forward(c_hf, [9, 10], [42, 43]),
                               rtol=1e-10, atol=1e-10)


def test_fast_cache_grows_past_its_first_chunk() -> None:
    model = _llama(2)
    fast, hf = FastLlamaRunner(model), ModelRunner(model)
    c_fast, c_hf = fast.new_cache(), hf.new_cache()
    ids = torch.randint(0, 97, (250,), generator=torch.Generator().manual_seed(3))
    for start in range(0, 250, 50):  # several appends across the growth boundary
        chunk = ids[start : start + 50]
        out_fast = fast.forward(c_fast, chunk, range(start, start + 50))
        out_hf = hf.forward(c_hf, chunk, range(start, start + 50))
    torch.testing.assert_close(out_fast, out_hf, rtol=1e-10, atol=1e-10)
    assert c_fast.length == c_hf.length == 250


def test_make_runner_falls_back_for_unsupported_models() -> None:
    model = _llama(4)
    model.config.hidden_act = "gelu"
    assert supports(model) is not None
    assert type(make_runner(model, "auto")) is ModelRunner
    with pytest.raises(ValueError, match="fast runner cannot run"):
        make_runner(model, "fast")


@pytest.mark.parametrize("model_fn", [lambda: _llama(4), lambda: _llama(2), _qwen2], ids=["mha-tied", "gqa", "qwen2-bias"])
def test_the_runner_keeps_one_copy_of_the_weights_and_the_hf_module_still_runs(model_fn) -> None:
    model = model_fn()
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
    fast = FastLlamaRunner(model)
    held = [fast.lm_head, fast.norm, fast.embed] + [w for layer in fast.layers for w in layer]
    runner_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t is not None}
    # every parameter of the HF module is a view into the runner's weights: one copy in memory
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= set(runner_storages)
    assert sum(runner_storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    cache = fast.new_cache()
    torch.testing.assert_close(fast.forward(cache, ids[0], range(30)), before[0].float(), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ the output layer's and the weights' layouts
@pytest.mark.parametrize("vocab,block", [(97, 16), (96, 16), (97, 60), (97, 97)], ids=["padded", "exact", "two", "one"])
def test_the_blocked_output_layer_computes_the_plain_product(vocab, block) -> None:
    gen = torch.Generator().manual_seed(5)
    lm_head = torch.randn(48, vocab, generator=gen, dtype=torch.float64)  # [hidden, vocab]
    blocks = head_blocks(lm_head, block)
    num_blocks = -(-vocab // block)
    if num_blocks < 2:
        assert blocks is None
        return
    assert blocks.shape == (num_blocks, 48, block) and blocks.is_contiguous()
    assert not blocks[-1, :, vocab - (num_blocks - 1) * block :].any()  # the padding is zeros
    for rows in (1, 2, 5, 33):
        x = torch.randn(rows, 48, generator=gen, dtype=torch.float64)
        got = blocked_product(x, blocks, vocab)
        assert got.shape == (rows, vocab)
        torch.testing.assert_close(got, x @ lm_head, rtol=1e-12, atol=1e-12)


def test_the_runner_picks_its_weight_layouts_by_dtype(monkeypatch) -> None:
    """float32 on a CPU: contiguous [in, out] layers and a blocked copy of the output layer for 2+ rows, which
    changes no logit beyond float32 rounding; bfloat16: F.linear's own [out, in] storage (views, no copy) and no
    blocked copy; float64: contiguous [in, out], no blocked copy."""
    monkeypatch.setattr(cpu_platform, "HEAD_BLOCK", 16)
    assert FastLlamaRunner(_llama(2)).head_blocks is None
    bf16_model = _llama(2).to(torch.bfloat16)
    head_ptr = bf16_model.lm_head.weight.data_ptr()
    bf16 = FastLlamaRunner(bf16_model)
    assert bf16.head_blocks is None
    for layer in bf16.layers:
        for w in (layer[1], layer[3], layer[6], layer[7]):  # qkv, o, gate/up, down: [in, out] views of [out, in]
            assert w.t().is_contiguous() and not w.is_contiguous()
    assert bf16.lm_head.data_ptr() == head_ptr  # the model's own output layer, not a copy
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(6))
    bf16_hf = ModelRunner(bf16_model).forward(ModelRunner(bf16_model).new_cache(), prompt, range(40))
    torch.testing.assert_close(bf16.forward(bf16.new_cache(), prompt, range(40)), bf16_hf, rtol=0.05, atol=0.05)

    blocked, plain = FastLlamaRunner(_llama(2).float()), FastLlamaRunner(_llama(2).float())
    assert blocked.head_blocks is not None and blocked.head_blocks.shape == (7, 48, 16)
    assert all(w.is_contiguous() for layer in blocked.layers for w in (layer[1], layer[3], layer[6], layer[7]))
    plain.head_blocks = None
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    caches = [blocked.new_cache(), plain.new_cache()]
    torch.testing.assert_close(blocked.forward(caches[0], prompt, range(40)),
                               plain.forward(caches[1], prompt, range(40)), rtol=1e-5, atol=1e-5)
    step = ([5, 6, 7, 8], [40, 41, 40, 41], tree_attend_mask(40, ancestors))
    torch.testing.assert_close(blocked.forward(caches[0], *step), plain.forward(caches[1], *step), rtol=1e-5, atol=1e-5)
    assert torch.equal(blocked.forward(caches[0], [9], [42]), plain.forward(caches[1], [9], [42]))  # one row: lm_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tied_embeddings_gather_only_their_rows(dtype) -> None:
    """A tied model's input embeddings are columns of the [hidden, vocab] output layer, which is contiguous in
    float32 and a transposed view of [vocab, hidden] in half precision on a CPU: in both the gather equals the
    embedding table's rows and makes no tensor the size of the table (a gather across the view's strides copied
    the whole 49,152 x 576 table of SmolLM2 first: 57 ms of every bf16 step)."""
    from torch.profiler import ProfilerActivity, profile

    model = _llama(4).to(dtype)
    runner = FastLlamaRunner(model)
    assert runner.embed is None  # tied
    table = model.model.embed_tokens.weight.detach()  # [vocab, hidden]
    ids = torch.tensor([5, 0, 96, 5])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # sees allocations inside ops
        rows = runner._embed(ids)
    assert torch.equal(rows, table[ids])
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= rows.numel() * rows.element_size(), (largest, table.numel() * table.element_size())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attention_through_float32(monkeypatch, dtype) -> None:
    """On a CPU without native half-precision arithmetic (``_UPCAST_DTYPES``, forced here) the attention of a
    one-row session (a decode row) runs in float32 on copies of the half-precision query, keys and values, in
    the per-session and the padded calls alike, and the logits stay as close to the float64 model's as the
    half-precision kernels' are (a wrong cast or scale would not); prompt chunks, decode rows and a tree."""
    import numpy as np

    monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset({dtype}))
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[0], q.shape[2], (q.dtype, k.dtype, v.dtype)))  # sessions, query rows, dtypes
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)  # both modules' F
    exact = FastLlamaRunner(_llama(2))
    half, kernels = FastLlamaRunner(_llama(2).to(dtype)), FastLlamaRunner(_llama(2).to(dtype))
    monkeypatch.setattr(sdpa_attention, "PAD_LIMIT", 20 * half.kv_size)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n) for n in (3, 5, 60)]  # the short two share the padded call, 60 has its own
    pools = [r.new_pool(num_blocks=64, block_size=4) for r in (exact, half, kernels)]
    caches = [[pool.open(len(p) + 8) for p in prompts] for pool in pools]
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [(np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]),
              [len(p) for p in prompts], [None] * 3),
             ([7, 8, 9], [len(p) for p in prompts], [1, 1, 1], [None] * 3),
             ([1, 2, 3, 4, 5], [4, 6, 61, 62, 62], [1, 1, 3], [None, None, tree_attend_mask(61, ancestors)])]
    for ids, positions, num_new, attends in steps:
        seen.clear()
        got = half.forward_batch(caches[1], ids, positions, num_new, attends)
        assert {g for g, _, _ in seen} == {1, 2}, seen  # the per-session and the padded call
        assert all(d == ((torch.float32 if n == 1 else dtype),) * 3 for _, n, d in seen), seen
        want = exact.forward_batch(caches[0], ids, positions, num_new, attends).double()
        monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset())  # the half-precision kernels throughout
        monkeypatch.setattr(cpu_platform, "_NATIVE_UPCAST_ROWS", {})
        plain = kernels.forward_batch(caches[2], ids, positions, num_new, attends).double()
        monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset({dtype}))
        error, kernel_error = (got.double() - want).abs(), (plain - want).abs()
        assert error.max() <= 1.25 * kernel_error.max() and error.mean() <= 1.25 * kernel_error.mean(), (
            error.max(), kernel_error.max(), error.mean(), kernel_error.mean())


@pytest.mark.parametrize(("dtype", "native", "frozen_rows"), [(torch.float32, False, [6, 1, 4, 5]),
                                                              (torch.bfloat16, False, [1, 4]),
                                                              (torch.bfloat16, True, [1, 4, 5])])
def test_the_frozen_stack_runs_the_steps_it_is_fastest_for(monkeypatch, dtype, native, frozen_rows) -> None:
    """With a frozen stack (here the uncompiled ``_FrozenStack``, the same arithmetic as the eager layers), float32
    runs every step through it; half precision on a CPU without native support runs steps of up to
    ``FROZEN_HALF_MAX_ROWS`` rows (4 here) through it, with AVX-512-BF16 the steps below
    ``NATIVE_BF16_UPCAST_ROWS`` (6 here), and larger ones (prompt chunks, big trees, large batches) through the
    eager layers, with the same logits either way."""
    from specmesh.fast_llama import _FrozenStack

    monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset() if native else frozenset({torch.bfloat16}))
    monkeypatch.setattr(cpu_platform, "_NATIVE_UPCAST_ROWS", {torch.bfloat16: 6} if native else {})
    monkeypatch.setattr(cpu_platform, "FROZEN_HALF_MAX_ROWS", 4)
    model = _llama(2).to(dtype)
    eager, frozen = FastLlamaRunner(model), FastLlamaRunner(model)
    stack, rows_seen = _FrozenStack(frozen), []

    def spy(x, cos, sin):
        rows_seen.append(x.shape[0])
        return stack(x, cos, sin)

    frozen._stack = spy
    caches = [runner.new_cache() for runner in (eager, frozen)]
    for ids, start in (([5, 6, 7, 8, 9, 10], 0), ([11], 6), ([12, 13, 14, 15], 7), ([1, 2, 3, 4, 5], 11)):
        positions = list(range(start, start + len(ids)))
        want, got = (runner.forward(cache, ids, positions) for runner, cache in zip((eager, frozen), caches, strict=True))
        assert torch.equal(got, want)
    assert rows_seen == frozen_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_turn_to_float32_from_the_rows_where_it_is_faster(monkeypatch, dtype) -> None:
    """``cpu_platform.linear`` on a CPU with AVX-512-BF16 but no AMX (forced here: ``_NATIVE_UPCAST_ROWS``): bf16 products of
    ``NATIVE_BF16_UPCAST_ROWS`` (4 here) or more rows go through float32, fewer keep the bf16 kernel; float16 (no
    native support) from 2 rows; float32 never. Either way within one rounding of the exact product."""
    monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset({torch.float16}))
    monkeypatch.setattr(cpu_platform, "_NATIVE_UPCAST_ROWS", {torch.bfloat16: 4})
    calls, upcast = [], cpu_platform._linear_upcast

    def spy(x, weight_t, bias):
        calls.append(x.shape[0])
        return upcast(x, weight_t, bias)

    monkeypatch.setattr(cpu_platform, "_linear_upcast", spy)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    for rows in (1, 2, 3, 4, 9):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        got, exact = cpu_platform.linear(x, weight.t()), x.double() @ weight.double().t()
        ulp = exact.abs().clamp_min(1e-3) * {torch.float32: 2**-20, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        assert got.dtype == dtype and ((got.double() - exact).abs() <= ulp + 1e-5).all()
    assert calls == {torch.float32: [], torch.bfloat16: [4, 9], torch.float16: [2, 3, 4, 9]}[dtype]


ONEDNN_BF16 = ({"avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()) or "avx_ne_convert" in cpu_flags()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")
@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN's bf16 weight reorder needs AVX-512 (BW, VL, DQ) or "
                    "AVX-NE-CONVERT, which this CPU lacks (the runner packs only where the CPU multiplies bf16)")
def test_bf16_products_on_packed_weights_equal_torchs(monkeypatch) -> None:
    """Where the CPU multiplies bf16 natively (forced here: ``cpu_platform.packs_products``) a bf16 runner packs its weights
    for oneDNN once and its products below the float32 rows run on them (not under --compile frozen, never in
    float32): the same logits as torch's kernel, one session or several; weights that would take more than
    PACKED_MAX_MEMORY_SHARE of the memory stay unpacked."""
    from spec_helpers import tiny_llama

    monkeypatch.setattr(cpu_platform, "_NATIVE_UPCAST_ROWS", {torch.bfloat16: 6})  # past it: float32 (not packed)
    monkeypatch.setattr(cpu_platform, "packs_products", lambda device, dtype: False)
    plain = FastLlamaRunner(tiny_llama(seed=5).to(torch.bfloat16))
    monkeypatch.setattr(cpu_platform, "packs_products", lambda device, dtype: dtype == torch.bfloat16)
    packed = FastLlamaRunner(tiny_llama(seed=5).to(torch.bfloat16))
    assert packed.packed and not plain.packed
    assert all(hasattr(w, cpu_platform._PACKED) for layer in packed.layers for w in (layer[1], layer[3], layer[6], layer[7]))
    assert not FastLlamaRunner(tiny_llama(seed=5).float()).packed
    calls, pointwise = [], torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        calls.append(x.shape[0])
        return pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    for rows in (1, 3, 9):
        got, want = [], []
        for runner, out in ((packed, got), (plain, want)):
            caches = [runner.new_cache() for _ in prompts]
            for cache, prompt in zip(caches, prompts, strict=True):
                runner.forward(cache, prompt, range(len(prompt)))
            ids = [list(range(10, 10 + rows)), list(range(20, 20 + rows))]
            starts = [len(p) for p in prompts]
            out.append(runner.forward(caches[0], ids[0], range(starts[0], starts[0] + rows)))
            out.append(runner.forward_batch(caches, ids[0] + ids[1], [*range(starts[0] + rows, starts[0] + 2 * rows),
                                                                       *range(starts[1], starts[1] + rows)],
                                            [rows, rows], [None, None]))
        for g, w in zip(got, want, strict=True):
            assert relative_error(g, w) <= 1e-2 and bool((g.argmax(-1) == w.argmax(-1)).all())
    assert calls and max(calls) < 6 and 1 in calls and 3 in calls  # 2 x 9 rows: float32, as before
    small = [torch.zeros(64, 32, dtype=torch.bfloat16).t()]
    assert not cpu_platform.pack_weights(small, memory_bytes=64 * 32 * 2 * 7)
    assert not hasattr(small[0], cpu_platform._PACKED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "out", "bias"), [(2, 300, False), (17, 1000, True), (5, 7, True)])
def test_half_precision_products_through_float32_equal_the_half_kernel(monkeypatch, dtype, rows, out, bias) -> None:
    """On a CPU without native bf16, products of 2+ rows in half precision run in float32 a block of the weight at
    a time (``_linear_upcast``): the exact product rounded once, as the half-precision kernel's (float32
    accumulation), up to summation order; one row keeps the half kernel. Blocks of 1,000 elements here, so the
    weights span several (with a ragged last one)."""
    monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset({dtype}))
    monkeypatch.setattr(cpu_platform, "UPCAST_BLOCK", 1000)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out, 64, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    exact = x.double() @ weight.double().t() + (b.double() if bias else 0)
    got = cpu_platform.linear(x, weight.t(), b)
    want = torch.addmm(b, x, weight.t()) if bias else x @ weight.t()
    assert got.dtype == dtype and got.shape == (rows, out)
    ulp = exact.abs().clamp_min(1e-3) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((got.double() - exact).abs() <= ulp + 1e-5).all()  # within one rounding of the exact product
    assert (got == want).float().mean() > 0.95  # and the half kernel's own result almost everywhere
    calls = []
    monkeypatch.setattr(cpu_platform, "_linear_upcast", lambda *a: calls.append(a) or x[:, :0])
    cpu_platform.linear(x[:1], weight.t(), b)
    assert not calls  # one row: the half-precision kernel



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_through_float32_use_the_runners_float32_copies(monkeypatch, dtype) -> None:
    """A half-precision runner whose products go through float32 (forced here) keeps float32 copies of its layer
    weights and output layer (``_FLOAT32``) and multiplies by them: the same logits as converting each weight per
    call, one session or a batch with a prompt chunk; none in float32 or past the memory share
    (``keep_float32_copies``)."""
    from spec_helpers import tiny_llama

    monkeypatch.setattr(cpu_platform, "_UPCAST_DTYPES", frozenset({dtype}))
    monkeypatch.setattr(cpu_platform, "packs_products", lambda device, dtype: False)
    keep = cpu_platform.keep_float32_copies
    monkeypatch.setattr(cpu_platform, "keep_float32_copies", lambda weights, memory_bytes=None: False)
    plain = FastLlamaRunner(tiny_llama(seed=7).to(dtype))
    monkeypatch.setattr(cpu_platform, "keep_float32_copies", keep)
    copied = FastLlamaRunner(tiny_llama(seed=7).to(dtype))
    assert copied.float32_copies and not plain.float32_copies
    weights = [w for layer in copied.layers for w in (layer[1], layer[3], layer[6], layer[7])] + [copied.lm_head]
    for w in weights:
        w32 = getattr(w, cpu_platform._FLOAT32)
        assert w32.dtype == torch.float32 and w32.shape == w.shape and torch.equal(w32, w.float())
    assert not FastLlamaRunner(tiny_llama(seed=7).float()).float32_copies
    calls, upcast = [], cpu_platform._linear_upcast

    def spy(x, weight_t, bias):
        calls.append(hasattr(weight_t, cpu_platform._FLOAT32))
        return upcast(x, weight_t, bias)

    monkeypatch.setattr(cpu_platform, "_linear_upcast", spy)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    outs = []
    for runner in (copied, plain):
        caches = [runner.new_cache() for _ in prompts]
        first = runner.forward(caches[0], prompts[0], range(len(prompts[0])))
        batch = runner.forward_batch(caches, [11, 12, 13] + prompts[1], [8, 9, 10, *range(len(prompts[1]))],
                                     [3, len(prompts[1])], [None, None])
        outs.append((first, batch))
    for got, want in zip(outs[0], outs[1], strict=True):
        assert relative_error(got, want) <= 1e-2 and bool((got.argmax(-1) == want.argmax(-1)).all())
    assert any(calls) and not all(calls)  # the copied runner's products by its copies, the plain one's converted
    small = [torch.zeros(64, 32, dtype=dtype).t()]
    assert not cpu_platform.keep_float32_copies(small, memory_bytes=64 * 32 * 4 * 7)
    assert not hasattr(small[0], cpu_platform._FLOAT32)
    assert cpu_platform.keep_float32_copies(small, memory_bytes=64 * 32 * 4 * 8)
    assert torch.equal(getattr(small[0], cpu_platform._FLOAT32), small[0].float())
    setattr(small[0], cpu_platform._FLOAT32, torch.ones(32, 64))  # what is multiplied is the copy
    assert torch.equal(upcast(torch.ones(3, 32, dtype=dtype), small[0], None), torch.full((3, 64), 32.0, dtype=dtype))

def test_greedy_equals_ar_through_the_blocked_output_layer(monkeypatch) -> None:
    """A float32 target whose tree steps' logits come from the blocked output layer (its one-row AR steps from
    the whole matrix) keeps greedy speculative output equal to AR, for a tree proposer and a chain."""
    from spec_helpers import add_cycles, engine_for, greedy, make_prompts, tiny_llama

    monkeypatch.setattr(cpu_platform, "HEAD_BLOCK", 32)
    target = add_cycles(tiny_llama(seed=21), seed=22).float()
    runner = FastLlamaRunner(target)
    assert runner.head_blocks is not None
    ar = engine_for(runner)
    accepted = 0
    for proposer, budget in (("prompt_lookup_tree", (12, 5)), ("copy", (4, 4))):
        engine = engine_for(runner, proposer, *budget)
        for prompt in make_prompts(6, seed=7):
            res = engine.generate(prompt, greedy(24))
            assert res.token_ids == ar.generate(prompt, greedy(24)).token_ids
            accepted += sum(s.num_accepted for s in res.stats.steps)
    assert accepted > 0


# ------------------------------------------------------------------ torch.compile of the layers (--compile)
def test_compile_choice_is_cuda_only_by_default(monkeypatch) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert compile_choice("auto", torch.device("cpu")) == "off"  # slower (on) or minutes to compile (frozen)
    assert compile_choice("on", torch.device("cpu")) == "on" and compile_choice("off", torch.device("cuda")) == "off"
    assert compile_choice("frozen", torch.device("cpu")) == "frozen"
    monkeypatch.setenv(COMPILE_ENV, "on")
    assert compile_choice("auto", torch.device("cpu")) == "on"
    with pytest.raises(ValueError, match="compile mode"):
        compile_choice("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="'frozen' is for a CPU"):
        compile_choice("frozen", torch.device("cuda"))


@pytest.mark.slow
def test_compiled_layers_keep_the_eager_logits_and_greedy_output(caplog) -> None:
    """``compile_layers="on"`` on the CPU (inductor's C++ backend; CUDA takes the same path with Triton kernels):
    the logits of a prefill, a decode row and a tree step stay within float32 rounding of the eager runner's,
    and speculative greedy decoding through the compiled runner equals its plain greedy decoding."""
    from spec_helpers import engine_for, greedy, tiny_llama

    eager, compiled = (FastLlamaRunner(tiny_llama(seed=3), compile_layers=mode) for mode in ("off", "on"))
    assert compiled.compiled and not eager.compiled
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    steps = [(prompt, list(range(30)), None), ([7], [30], None), ([1, 2, 3], [31, 32, 31], tree_attend_mask(31, ancestors))]
    caches = [eager.new_cache(), compiled.new_cache()]
    for ids, pos, attend in steps:
        want, got = (runner.forward(cache, ids, pos, attend) for runner, cache in zip((eager, compiled), caches, strict=True))
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    sampling = greedy(40)
    plain = engine_for(compiled).generate(prompt, sampling).token_ids
    assert engine_for(compiled, "prompt_lookup_tree").generate(prompt, sampling).token_ids == plain
    # a compiled layer that does not match eager is refused when asked for, and falls back to eager under auto
    with patch.dict("specmesh.fast_llama.COMPILE_TOLERANCE", {torch.float64: 0.0}):
        with pytest.raises(ValueError, match="differs from eager"):
            compiled._compiled_dense(required=True)
        with caplog.at_level(logging.WARNING, logger="specmesh.fast_llama"):
            assert compiled._compiled_dense(required=False) == (_pre_attention, _post_attention)
    assert "run eager" in caplog.text


@pytest.mark.slow
def test_the_frozen_stack_keeps_the_eager_logits_and_greedy_output(caplog) -> None:
    """``compile_layers="frozen"`` (the whole stack compiled with its weights as constants, attention an opaque
    custom op): the logits of a prefill, a decode row and a tree step over a paged pool, alone and batched with
    another session, stay within float32 rounding of the eager runner's, and speculative greedy decoding through it
    equals its plain greedy decoding; a mismatch is refused when asked for and falls back to eager under auto."""
    from spec_helpers import add_cycles, engine_for, greedy, tiny_llama

    model = add_cycles(tiny_llama(seed=21), seed=22).float()
    eager, frozen = FastLlamaRunner(model, compile_layers="off"), FastLlamaRunner(model, compile_layers="frozen")
    assert frozen.compiled and frozen._stack is not None and not eager.compiled
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    pools = [runner.new_pool(64, 16) for runner in (eager, frozen)]
    caches = [[pool.open(40) for _ in range(2)] for pool in pools]
    tree = tree_attend_mask(11, ancestors)
    steps = [  # (sessions, their new ids, positions, masks): a batched prefill, one decode row, a batched tree step
        ((0, 1), [prompt, prompt[:11]], [list(range(30)), list(range(11))], [None, None]),
        ((0,), [[7]], [[30]], [None]),
        ((0, 1), [[8], [1, 2, 3]], [[31], [11, 12, 11]], [None, tree]),
    ]
    for sessions, ids, pos, attends in steps:
        want, got = (runner.forward_batch([cache[i] for i in sessions], [t for seq in ids for t in seq],
                                          [p for seq in pos for p in seq], [len(seq) for seq in ids], attends)
                     for runner, cache in zip((eager, frozen), caches, strict=True))
        assert got.shape == want.shape
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    sampling = greedy(40)
    plain = engine_for(eager).generate(prompt, sampling).token_ids
    assert engine_for(frozen).generate(prompt, sampling).token_ids == plain
    result = engine_for(frozen, "prompt_lookup_tree").generate(prompt, sampling)
    assert result.token_ids == plain and sum(s.num_accepted for s in result.stats.steps) > 0
    # the check of a compiled stack (on the stack compiled above: a second compile costs a minute)
    with patch.dict("specmesh.fast_llama.COMPILE_TOLERANCE", {torch.float32: 0.0}):
        with pytest.raises(ValueError, match="differs from eager"):
            frozen._checked_stack(frozen._stack, required=True)
        with caplog.at_level(logging.WARNING, logger="specmesh.fast_llama"):
            assert frozen._checked_stack(frozen._stack, required=False) is None
    assert frozen._stack is not None  # the runner keeps its stack through the checks
    assert "run eager" in caplog.text


@pytest.mark.parametrize(("num_kv_heads", "dtype"), [(4, torch.float64), (2, torch.float64), (2, torch.float32)])
def test_a_stitched_table_is_read_in_place(monkeypatch, num_kv_heads, dtype) -> None:
    """A decode row of a session whose blocks are not one run (prefix-cache blocks and its own, a fragmented
    pool) attends run by run on views of the pool, its runs merged by their log-sum-exp: no gather of its
    context, logits those of the same session in a contiguous cache (float64: to the float32 rounding of the
    logits; float32 at its own precision), alone or beside other sessions (GQA: query heads folded onto their key head)."""
    import numpy as np

    from specmesh import kv_pool
    from specmesh.kv_pool import PagedKVCache

    monkeypatch.setattr(sdpa_attention, "IN_PLACE_MIN_BYTES", 0)  # these contexts are tiny: read every one in place
    monkeypatch.setattr(sdpa_attention, "IN_PLACE_ALONE_BYTES", 0)
    model = _llama(num_kv_heads).to(dtype)
    runner = FastLlamaRunner(model)
    pool = runner.new_pool(num_blocks=96, block_size=4)
    pieces = [pool.allocator.allocate(4 * n) for n in (2, 1, 3, 2, 4, 2, 3)]  # runs of blocks, held apart
    tables = [pieces[0] + pieces[2] + pieces[4], pieces[1] + pieces[5], pieces[3] + pieces[6][::-1]]
    gathers, gather = [], kv_pool.gather_blocks

    def spy(layer, blocks, block_size):
        gathers.append(len(blocks))
        return gather(layer, blocks, block_size)

    monkeypatch.setattr(kv_pool, "gather_blocks", spy)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (23, 9, 30)]
    paged = [PagedKVCache(pool, table) for table in tables]  # the last one grows a block while decoding
    plain = [runner.new_cache() for _ in prompts]
    for caches in (paged, plain):
        for cache, prompt in zip(caches, prompts, strict=True):
            runner.forward(cache, prompt, list(range(len(prompt))))
    assert all(len(c.slot_runs(c.length)) > 1 for c in paged), [c.table for c in paged]
    tol = {torch.float64: 2e-6, torch.float32: 2e-5}[dtype]  # logits come back in float32 either way
    for step in range(6):  # decode rows: alone (session 0) and batched (all three)
        chosen = [0] if step % 2 == 0 else [0, 1, 2]
        ids = [int(torch.randint(0, 97, (1,), generator=gen)) for _ in chosen]
        positions = [paged[i].length for i in chosen]
        gathers.clear()
        got = runner.forward_batch([paged[i] for i in chosen], ids, positions, [1] * len(chosen), [None] * len(chosen))
        assert gathers == []
        want = torch.cat([runner.forward(plain[i], [t], [p]) for i, t, p in zip(chosen, ids, positions, strict=True)])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    runs = paged[0].slot_runs(paged[0].length)
    assert sum(b - a for a, b in runs) == paged[0].length  # the runs cover the positions once, in order
    slots = np.concatenate([np.arange(a, b) for a, b in runs])
    assert (slots == paged[0].host_slots[: paged[0].length]).all()


@settings(max_examples=200)
@given(st.lists(st.integers(0, 8 << 20), max_size=12))
def test_stitched_sessions_read_in_place_past_a_size_and_a_count(context_bytes) -> None:
    """in_place_sessions: a session reads in place past IN_PLACE_ALONE_BYTES whatever the others do, past
    IN_PLACE_MIN_BYTES exactly when IN_PLACE_SHARED or more sessions are that large, never below it."""
    alone, least = sdpa_attention.IN_PLACE_ALONE_BYTES, sdpa_attention.IN_PLACE_MIN_BYTES
    chosen = sdpa_attention.in_place_sessions(context_bytes)
    shared = sum(b >= least for b in context_bytes) >= sdpa_attention.IN_PLACE_SHARED
    assert len(chosen) == len(context_bytes)
    for size, in_place in zip(context_bytes, chosen, strict=True):
        assert in_place == (size >= alone or (shared and size >= least))


def test_a_short_stitched_table_is_gathered(monkeypatch) -> None:
    """A decode row over a stitched table whose keys and values are under IN_PLACE_ALONE_BYTES, alone in its
    forward, gathers its table (one copy, one call: cheaper than a call per run and a merge), with the logits of a
    contiguous cache; past it the same row reads in place."""
    from specmesh import kv_pool
    from specmesh.kv_pool import PagedKVCache

    runner = FastLlamaRunner(_llama(2).to(torch.float64))
    pool = runner.new_pool(num_blocks=16, block_size=4)
    first, _gap, second = (pool.allocator.allocate(4 * n) for n in (2, 1, 2))
    gathers, gather = [], kv_pool.gather_blocks
    monkeypatch.setattr(kv_pool, "gather_blocks", lambda *a: gathers.append(1) or gather(*a))
    prompt = list(range(3, 17))
    paged, plain = PagedKVCache(pool, first + second), runner.new_cache()
    for cache in (paged, plain):
        runner.forward(cache, prompt, list(range(len(prompt))))
    assert len(paged.slot_runs(paged.length)) == 2
    for alone_bytes, gathered in ((sdpa_attention.IN_PLACE_ALONE_BYTES, True), (0, False)):
        monkeypatch.setattr(sdpa_attention, "IN_PLACE_ALONE_BYTES", alone_bytes)
        gathers.clear()
        position = paged.length
        got = runner.forward_batch([paged], [5], [position], [1], [None])
        assert bool(gathers) == gathered
        torch.testing.assert_close(got, runner.forward(plain, [5], [position]), rtol=2e-6, atol=2e-6)
