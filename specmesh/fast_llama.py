"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2), on the HF model's own weights.

Why: at the sizes speculative drafters run at, a Hugging Face forward spends most
of its time in framework overhead (mask construction, cache objects, module
dispatch), not in arithmetic; the 3.7M-parameter draft of the benchmark pair
takes ~3 ms per HF forward. This runner does the same math with fused QKV and
gate/up projections, a preallocated KV cache and precomputed rotary tables.
It is numerically the same model (tests compare its logits with the HF forward)
and exposes the ModelRunner interface, so everything else is unaware of it.

Models it cannot run exactly (other architectures, sliding windows, dynamic
rope scaling, non-SiLU MLPs) are refused by ``supports``; ``make_runner`` then
falls back to the generic Hugging Face runner.

Attention has two backends (``attention=``): ``sdpa``, PyTorch's scaled_dot_product_attention
per session under a dense mask (any device and dtype), and ``triton``, the fused tree-attention
kernel (``kernels/tree_attention.py``): every session of a forward in one launch per layer,
keys/values read from the paged pool through the block tables, tree masks as ancestor bits
(``TreeMask``). ``auto`` takes $SPECMESH_ATTENTION when set, else the kernel for a CUDA model
when triton imports, else SDPA. The kernel path needs all caches of a forward in one storage
(PagedKVCaches of one pool, or a single FastKVCache, read as one block) and structured masks
(``TreeMask`` or causal); a forward with a dense mask tensor or several FastKVCaches runs SDPA.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specmesh import checkpoint
from specmesh.contract import ModelInfo
from specmesh.cuda_graphs import PoolGraphs, graph_choice
from specmesh.kv_pool import DEFAULT_BLOCK_SIZE, KVPool, PagedKVCache, write_slots
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.models import ATTENTION_BACKENDS, COMPILE_MODES, cpu_flags, cpu_has_fast_bf16
from specmesh.padded_attention import PAD_LIMIT, PAD_MAX_NEW, padded_layout, padded_sdpa

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
ALIGN_INT32 = 4  # int32 elements per 16 bytes
# SDPA backends on CUDA: not cuDNN's, which builds (and caches) an execution graph per new shape, hundreds of
# milliseconds each, and every step here brings new lengths
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

ATTENTION_ENV = "SPECMESH_ATTENTION"  # what ``auto`` means when set (e.g. triton, to force the kernel in tests)
COMPILE_ENV = "SPECMESH_COMPILE"  # what ``compile_layers="auto"`` means when set (on / off)
# how close the compiled layer must come to the eager one on the start-up probe, relative to the eager output's
# largest value (inductor fuses and reorders float32 arithmetic, and does not round intermediates as eager does:
# the norms run in float32 in every dtype, as in transformers)
COMPILE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
SUPPORTED_TYPES = set(checkpoint.SUPPORTED_TYPES)
STATIC_ROPE = {"default", "linear", "llama3", "yarn", "longrope"}
HEAD_BLOCK = 4096  # columns per block of the output layer's blocked copy (``head_blocks``; 2,048-8,192 measure alike)


def supports(model: PreTrainedModel) -> str | None:
    """None if the fast path can run ``model`` exactly, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        if cfg.sliding_window < cfg.max_position_embeddings:
            return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} changes with sequence length"
    return None


class FastKVCache:
    """Keys/values of one session in preallocated tensors, grown in chunks.

    keys/values: [num_layers, num_kv_heads, capacity, head_dim].
    """

    CHUNK = 256

    @torch.inference_mode()
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, max_len: int):
        self.shape = (num_layers, num_kv_heads, 0, head_dim)
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.keys = torch.empty(self.shape, dtype=dtype, device=device)
        self.values = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0

    @torch.inference_mode()
    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        new_cap = min(max(length, capacity * 2, self.CHUNK), max(self.max_len, length))
        layers, heads, _, dim = self.shape
        keys = torch.empty((layers, heads, new_cap, dim), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep(self, prefix_len: int, keep_offsets: Sequence[int]) -> None:
        """Keep positions [0, prefix_len) plus ``prefix_len + o`` for o in keep_offsets (ascending)."""
        offsets = list(keep_offsets)
        if offsets != list(range(len(offsets))):
            src = prefix_len + torch.tensor(offsets, dtype=torch.long).to(self.device, non_blocking=True)
            dst = slice(prefix_len, prefix_len + len(offsets))
            self.keys[:, :, dst] = self.keys.index_select(2, src)
            self.values[:, :, dst] = self.values.index_select(2, src)
        self.length = prefix_len + len(offsets)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [num_kv_heads, n, head_dim] for positions [start, start + n) (reserved)."""
        self.keys[layer, :, start : start + keys.shape[1]] = keys
        self.values[layer, :, start : start + keys.shape[1]] = values

    def kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_kv_heads, end, head_dim] keys and values of positions [0, end) (views)."""
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_kv_heads, length, head_dim] keys and values of one layer."""
        return self.kv(layer, self.length)


def in_out_layout(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [in, out], in the layout whose ``x @ w`` runs fastest for a step's few rows (1-16), which
    depends on the dtype. float32/64: a contiguous [in, out] copy, where MKL's small-M path runs the output layer
    at 1-3 rows 2-3x faster than ``F.linear`` on [out, in] and large prefills at the same speed. bfloat16 and
    float16 on a CPU: the transposed view of [out, in] (no copy), i.e. ``F.linear``'s own kernel; on a CPU
    without native bf16 (no AVX-512-BF16/AMX), ``x @ w`` on a contiguous [in, out] bf16 matrix takes a
    reference path, 2.5-6x slower in the layers and 30-35x in a 49,152-token output layer
    (benchmarks/results/cpu_forward.md)."""
    weight = weight.detach()
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        return weight.t()
    return weight.t().contiguous()


def head_blocks(lm_head: torch.Tensor, block: int = HEAD_BLOCK) -> torch.Tensor | None:
    """The output layer lm_head [hidden, vocab] as ``ceil(vocab / block)`` contiguous column blocks
    [num_blocks, hidden, block] (the last one zero-padded), or None where the vocabulary is under two blocks.
    A copy, kept beside ``lm_head`` (which the embedding, Falcon heads and the HF module read)."""
    hidden, vocab = lm_head.shape
    num_blocks = -(-vocab // block)
    if num_blocks < 2:
        return None
    padded = lm_head.new_zeros(hidden, num_blocks * block)
    padded[:, :vocab] = lm_head
    return padded.reshape(hidden, num_blocks, block).permute(1, 0, 2).contiguous()


def blocked_product(x: torch.Tensor, blocks: torch.Tensor, vocab: int) -> torch.Tensor:
    """x [n, hidden] @ the output layer held as ``head_blocks`` [num_blocks, hidden, block] -> [n, vocab]: one
    batched product, each block's columns read contiguously. On a CPU in float32 this is 1.2-1.5x faster than
    either whole-matrix layout from 2 to 128 rows (MKL picks a poor kernel for a few rows against a 49,152-wide
    matrix; benchmarks/results/cpu_forward.md)."""
    out = torch.matmul(x, blocks)  # [num_blocks, n, block]
    out = out.transpose(0, 1).reshape(x.shape[0], -1)  # [n, num_blocks * block]
    return out if out.shape[1] == vocab else out[:, :vocab]


def _share(linears: Sequence[torch.nn.Module], weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Make ``linears`` (stacked along their outputs) use slices of ``weight_t`` [in, sum of outs] and ``bias``
    as their parameters, views without a copy, so that the model's own weights can be freed."""
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight_t[:, start:end].t(), requires_grad=False)  # [out, in] view
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight_t [in, out] (+ bias): through float32 or the weight's oneDNN-packed copy where those
    are faster (CPU, half precision; not while torch.compile traces)."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        if x.shape[0] >= (2 if x.dtype in _UPCAST_DTYPES else _NATIVE_UPCAST_ROWS.get(x.dtype, _NEVER)):
            return _linear_upcast(x, weight_t, bias)
        if _PACKING[0] and (packed := getattr(weight_t, _PACKED, None)) is not None:  # (CPU weights only)
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.addmm(bias, x, weight_t) if bias is not None else x @ weight_t


# On a CPU that multiplies bfloat16 natively (AVX-512-BF16 or AMX), oneDNN's linear on a weight reordered once
# into its blocked layout beats torch's bf16 GEMM, which takes the [out, in] weight as it is every call: a whole
# SmolLM2-135M forward 1.20-1.25x faster at 1-16 rows (Xeon VM with AVX-512-BF16, one thread, identical logits).
# The runner keeps the packed copy as an attribute of each weight tensor (``_PACKED``; one more copy of the
# weights, so only while they take at most PACKED_MAX_MEMORY_SHARE of the machine's memory) for the products
# below the rows that go through float32; float32 gains less there (0.95-1.15x) and keeps MKL's.
_PACKED = "_specmesh_onednn_packed"
_PACKING = [False]  # whether any runner packed its weights (one list lookup per product until one does)
PACKED_MAX_MEMORY_SHARE = 1 / 8
PACK_ROWS_HINT = 16  # the batch size oneDNN is told to expect (the packed layout serves any row count)


def _packs_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products of a model on ``device`` in ``dtype`` run on oneDNN-packed weights (see ``_PACKED``)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_fast_bf16()
            and torch.backends.mkldnn.is_available())


def pack_weights(weights: Sequence[torch.Tensor], memory_bytes: int | None = None) -> bool:
    """Give each of ``weights`` (CPU bf16, [in, out] views of [out, in] storage) its oneDNN-packed copy (``_linear``
    then uses it), unless the copies would take more than PACKED_MAX_MEMORY_SHARE of ``memory_bytes`` (default:
    the machine's physical memory). Returns whether it packed."""
    if not _fits_memory(sum(w.numel() * w.element_size() for w in weights), memory_bytes):
        return False
    for weight_t in weights:
        setattr(weight_t, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), PACK_ROWS_HINT))
    _PACKING[0] = True
    return True


def _fits_memory(nbytes: int, memory_bytes: int | None = None) -> bool:
    """Whether one more copy of the weights, ``nbytes``, takes at most PACKED_MAX_MEMORY_SHARE of ``memory_bytes``
    (default: the machine's physical memory)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return nbytes <= PACKED_MAX_MEMORY_SHARE * memory_bytes


# Products that go through float32 (``_linear_upcast``: large batches, prompt chunks, and on a CPU without native
# bf16 every step of 2+ rows) convert the half-precision weight block by block on every call: ~1.5 ms a layer of
# SmolLM2-135M, 40-50 ms a forward, whatever its rows. A runner whose products do that keeps a float32 copy of its
# weights (``_FLOAT32``: twice the half-precision bytes, so only within PACKED_MAX_MEMORY_SHARE of the memory) and
# multiplies by it instead: a SmolLM2-135M bf16 forward 8-12 % faster at 48-64 rows and with a 150-token prompt
# chunk (Xeon VM with AVX-512-BF16, one thread; the same products, accumulated in float32 and rounded once).
_FLOAT32 = "_specmesh_float32"


def _upcasts_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether some products of a model on ``device`` in ``dtype`` run through float32 (``_linear``)."""
    return device.type == "cpu" and (dtype in _UPCAST_DTYPES or dtype in _NATIVE_UPCAST_ROWS)


def keep_float32_copies(weights: Sequence[torch.Tensor], memory_bytes: int | None = None) -> bool:
    """Give each of ``weights`` (CPU half precision, [in, out] views) a float32 copy, the same view of its own
    storage, that ``_linear_upcast`` multiplies by instead of converting the weight on every call; none if the
    copies would take more than PACKED_MAX_MEMORY_SHARE of ``memory_bytes`` (default: the physical memory).
    Returns whether it kept them."""
    if not _fits_memory(sum(w.numel() * 4 for w in weights), memory_bytes):
        return False
    for weight_t in weights:
        setattr(weight_t, _FLOAT32, weight_t.float())  # (a transposed view stays one: [in, out] of [out, in])
    return True


# Without native bf16 (AVX-512-BF16, AMX), torch 2.13's CPU GEMM in bfloat16 takes a slow path: on this project's
# AVX2 VM 7-9x float32's at 17-64 rows, ~4x in a 49,152-row output layer; float16 likewise (no CPU but AMX-FP16
# multiplies it natively). Products of 2+ rows go through float32 there (``_linear_upcast``); one row keeps the
# half-precision kernel, which reads half the bytes and is as fast. The attention of decode rows runs in float32
# there too (``_SdpaAttention``): SDPA's one-query path in bfloat16 takes 1.4-2.2x as long as a float32 copy of the
# session's keys and values and SDPA on it (100-1,000 cached positions), while with 2+ query rows the half-precision
# kernel is 0-20 % faster than the copy.
_UPCAST_DTYPES = frozenset({torch.float16} | (set() if cpu_has_fast_bf16() else {torch.bfloat16}))
# With AVX-512-BF16 but no AMX, torch 2.13's bf16 GEMM reads half the bytes of float32's but computes more slowly:
# a whole bf16 forward with its products through float32 (``_linear_upcast``, weight conversion included) takes
# 1.02x / 0.92x / 0.87x / 0.78x the time at 32 / 48 / 64 / 128 rows for SmolLM2-135M, 0.96x / 0.87x / 0.84x / 0.74x
# for the benchmark pair's target (Xeon VM, one thread). Products of NATIVE_BF16_UPCAST_ROWS+ rows (large batches,
# prompt chunks) run through float32 there too; AMX multiplies bf16 many times faster than float32: never there.
NATIVE_BF16_UPCAST_ROWS = 48
_NATIVE_UPCAST_ROWS = ({torch.bfloat16: NATIVE_BF16_UPCAST_ROWS}
                       if "avx512_bf16" in cpu_flags() and "amx_bf16" not in cpu_flags() else {})
_NEVER = sys.maxsize
UPCAST_BLOCK = 256 * 1024  # weight elements converted at a time: 1 MiB in float32, so the copy stays in L2
# The frozen stack's bf16 GEMM templates beat the eager layers there up to a few rows (SmolLM2, one thread: 1.45x
# at 1 row, 1.08x at 8) and lose to ``_linear_upcast`` beyond (0.80x at 16, 0.69x at 24): larger steps run eager.
# With AVX-512-BF16 the same from NATIVE_BF16_UPCAST_ROWS (the pair's target: 38.2 / 47.9 ms frozen, 34.3 / 40.7
# eager at 48 / 64 rows): ``FastLlamaRunner._frozen_rows``.
FROZEN_HALF_MAX_ROWS = 8


def _linear_upcast(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_linear`` of half-precision x [n, in] and weight_t [in, out] in float32: by the weight's float32 copy where
    the runner keeps one (``_FLOAT32``), else the weight converted a block of output columns at a time (each block's
    copy stays in cache; a whole 49,152 x 576 output layer's would not); the products accumulated in float32 as the
    half-precision kernel's are, the result rounded once to x's dtype. 17 rows of SmolLM2-135M's layer
    (576 -> 1,728): 4.5 -> 0.95 ms; of its output layer: 128 -> 29 ms."""
    x32 = x.float()
    if (weight32 := getattr(weight_t, _FLOAT32, None)) is not None:
        out = x32 @ weight32
        if bias is not None:
            out += bias
        return out.to(x.dtype)
    weight = weight_t.t()  # [out, in]: the layout half-precision weights keep on a CPU (``in_out_layout``)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    block = max(1, UPCAST_BLOCK // weight.shape[1])
    for start in range(0, weight.shape[0], block):
        torch.mm(x32, weight[start : start + block].float().t(), out=out[:, start : start + block])
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (the start-up checks of compiled layers and CUDA graphs)."""
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in LlamaRMSNorm's op order: normalise in float32, cast back, then scale. In float32 (no casts) it is
    torch's fused ``rms_norm``: one op for eight (on this project's CPU 20 against 31 µs a call, the same values);
    other dtypes keep the casts' rounding points (the fused op rounds once, and computes float64 in float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# One layer's dense work around attention, as two pure functions of the layer's weights: what ``--compile`` hands
# to torch.compile (one compilation serves every layer of a model; the attention between them stays eager, with
# its paged writes and kernel launch).
def _pre_attention(x: torch.Tensor, ln1, qkv_w, qkv_b, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> q [heads, T, head_dim], k and v [kv_heads, T, head_dim]: norm, fused QKV, rotary on q, k."""
    total, q_size, kv_size = x.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    qkv = _linear(_rms(x, ln1, eps), qkv_w, qkv_b)
    q = qkv[:, :q_size].view(total, num_heads, head_dim).transpose(0, 1)
    k = qkv[:, q_size : q_size + kv_size].view(total, num_kv_heads, head_dim).transpose(0, 1)
    v = qkv[:, q_size + kv_size :].view(total, num_kv_heads, head_dim).transpose(0, 1)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _post_attention(x: torch.Tensor, attn: torch.Tensor, o_w, o_b, ln2, gate_up, down, eps: float) -> torch.Tensor:
    """The residual stream after the output projection (attn: [T, heads * head_dim]) and the gated MLP."""
    x = x + _linear(attn, o_w, o_b)
    gate, up = _linear(_rms(x, ln2, eps), gate_up).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down)


# ---------------------------------------------------------------------------------- attention
class _SdpaAttention:
    """PyTorch SDPA. Sessions in one paged pool write their new keys/values with one scatter per layer; of those,
    the ones with short contexts and few new rows attend in one padded SDPA call (``padded_attention``), the
    rest in one call per session over their own span under a dense [n, end] mask (a view of the pool when
    their blocks are contiguous, else a gathered copy; a decode row over a large stitched table on the CPU: one
    call per run of its blocks, on views, merged by log-sum-exp, ``in_place_sessions``). Index tensors are built
    once per forward, on the host, and copied once."""

    def __init__(self, runner: FastLlamaRunner, caches, num_new: Sequence[int], attends) -> None:
        # spans: [cache, packed rows, start, end, mask, causal, runs of a stitched decode row read in place or None]
        self.runner, self.spans, self.padded = runner, [], None
        # a decode row in half precision on a CPU without native support: its attention in float32
        # (``_UPCAST_DTYPES``; SDPA's one-query path in bfloat16 takes 2x as long as its copy in float32 there)
        self.compute_dtype = torch.float32 if runner.device.type == "cpu" and runner.dtype in _UPCAST_DTYPES else None
        # one scatter for the new rows of several sessions of one pool; a single session writes its own slice
        pool = getattr(caches[0], "pool", None) if len(caches) > 1 else None
        if pool is not None and not all(getattr(c, "pool", None) is pool for c in caches):
            pool = None
        self.pool = pool
        starts = [c.length for c in caches]
        ends = [a + n for a, n in zip(starts, num_new, strict=True)]
        padded = [False] * len(caches)
        if pool is not None:  # short contexts with few new rows: one padded call (padded_attention.py)
            padded = [end * runner.kv_size <= PAD_LIMIT and n <= PAD_MAX_NEW for end, n in zip(ends, num_new, strict=True)]
            if sum(padded) < 2:
                padded = [False] * len(caches)
        row, stitched = 0, []  # stitched: the spans of decode rows over stitched tables
        for cache, n, attend, start, end, pad in zip(caches, num_new, attends, starts, ends, padded, strict=True):
            if attend is not None:
                assert attend.shape == (n, end), (attend.shape, start, n)
            if not pad:
                mask, causal = None, False  # None: one new token sees everything
                if attend is not None:
                    mask = attend.dense(runner.device) if isinstance(attend, TreeMask) else attend.to(runner.device)
                elif n > 1 and start == 0:  # a first prompt chunk: SDPA's own causal mask (it skips the blocks above
                    causal = True           # the diagonal: half the work of a dense mask, and no mask to build)
                elif n > 1:
                    mask = torch.ones(n, end, dtype=torch.bool, device=runner.device).tril(diagonal=start)
                elif isinstance(cache, PagedKVCache) and cache.base is None and runner.device.type == "cpu":
                    stitched.append(len(self.spans))  # a table of prefix-cache blocks + its own: maybe in place
                self.spans.append([cache, slice(row, row + n), start, end, mask, causal, None])
            row += n
        if stitched:  # large ones read on views of the pool, run by run; the others gather their table
            position_bytes = 2 * runner.kv_size * self.spans[stitched[0]][0].pool.keys.element_size()
            chosen = in_place_sessions([self.spans[i][3] * position_bytes for i in stitched])
            for i in (i for i, in_place in zip(stitched, chosen, strict=True) if in_place):
                self.spans[i][6] = self.spans[i][0].slot_runs(self.spans[i][3])
        # the stitched sessions' runs: which session each run's output belongs to, for one merge per layer
        counts = [len(span[6]) for span in self.spans if span[6] is not None]
        self.run_owner = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts)) if counts else None
        if pool is not None:
            self._index(caches, starts, num_new, attends, padded, row)

    def _index(self, caches, starts: list[int], num_new: Sequence[int], attends, padded: list[bool], total: int) -> None:
        """The device indices of the batched write and the padded call, built on the host and copied at once."""
        index = [write_slots(caches, starts, num_new)]
        if any(padded):
            starts, num_new = np.asarray(starts), np.asarray(num_new)
            cu = np.concatenate([[0], np.cumsum(num_new)])
            chosen = np.flatnonzero(padded)
            layout = padded_layout([caches[r].table for r in chosen], self.pool.block_size, starts[chosen],
                                   num_new[chosen], cu[chosen], [attends[r] for r in chosen], total)
            rows = None
            if not all(padded):  # the packed rows the padded call answers
                rows = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in chosen])
            parts = [layout.key_blocks, layout.unwritten, layout.query_rows, layout.out_rows, rows]
            index += [p for p in parts if p is not None]
        if len(index) == 1:
            self.write_slots = torch.from_numpy(index[0]).to(self.runner.device, non_blocking=True)
            return
        pieces = list(torch.from_numpy(np.concatenate(index)).to(self.runner.device, non_blocking=True)
                      .split([len(p) for p in index]))
        self.write_slots = pieces.pop(0)
        if any(padded):
            key_blocks, unwritten, query_rows, out_rows, rows = (None if p is None else pieces.pop(0) for p in parts)
            mask = layout.mask
            if mask is not None:
                mask = torch.from_numpy(mask).to(self.runner.device, non_blocking=True)
            self.padded = (layout, key_blocks, unwritten, query_rows, out_rows, mask, rows)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [heads, T, head_dim]; k/v: [kv_heads, T, head_dim] -> [T, heads * head_dim]."""
        if self.runner.device.type != "cuda":
            return self._attend(layer, q, k, v)
        with sdpa_kernel(SDPA_BACKENDS):
            return self._attend(layer, q, k, v)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        groups = runner.num_heads // runner.num_kv_heads
        if self.pool is not None:
            keys, values = self.pool.keys[layer], self.pool.values[layer]  # [kv_heads, slots, head_dim]
            keys.index_copy_(1, self.write_slots, k)
            values.index_copy_(1, self.write_slots, v)
        outs, compute, stitched = [], self.compute_dtype, []
        for cache, rows, start, end, mask, causal, runs in self.spans:
            if self.pool is None:
                cache.write(layer, start, k[:, rows], v[:, rows])
            if runs is not None:
                stitched += self._attend_runs(cache.pool, layer, q[:, rows], runs)
                outs.append(None)  # merged below, with every stitched session's
                continue
            keys, values = cache.kv(layer, end)  # [kv_heads, end, head_dim]
            q_rows, upcast = q[None, :, rows], compute is not None and rows.stop - rows.start == 1
            if upcast:
                q_rows, keys, values = q_rows.to(compute), keys.to(compute), values.to(compute)
            out = F.scaled_dot_product_attention(
                q_rows, keys[None], values[None], attn_mask=mask, is_causal=causal, scale=runner.scale,
                enable_gqa=groups > 1,
            )[0].transpose(0, 1).reshape(rows.stop - rows.start, runner.q_size)  # [n, heads * head_dim]
            outs.append(out.to(q.dtype) if upcast else out)
        if stitched:
            merged = iter(self._merge_runs(stitched).to(q.dtype).split(1))  # [1, heads * head_dim] each
            outs = [next(merged) if out is None else out for out in outs]
        if self.padded is None:
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, heads * head_dim]
        layout, key_blocks, unwritten, query_rows, out_rows, mask, padded_rows = self.padded
        attn = padded_sdpa(q, self.pool.keys[layer], self.pool.values[layer], layout, key_blocks, unwritten,
                           query_rows, out_rows, mask, runner.scale,
                           compute if layout.max_new == 1 else None)  # [padded rows, heads * head_dim]
        if padded_rows is None:
            return attn
        out = attn.new_empty(q.shape[1], runner.q_size)
        out.index_copy_(0, padded_rows, attn)
        for (_, rows, *_), part in zip(self.spans, outs, strict=True):
            out[rows] = part
        return out

    def _attend_runs(self, pool: KVPool, layer: int, q: torch.Tensor, runs: list[tuple[int, int]]):
        """One decode row q [heads, 1, head_dim] over a stitched table, read in place run by run (slots [a, b) of
        the pool: views, where a gather would copy the session's whole context every layer of every step):
        [(out [1, kv_heads, groups, head_dim], log-sum-exp [1, kv_heads, groups] float32)] per run, merged by
        ``_merge_runs``. The query heads of a key head are its rows (GQA without repeating keys)."""
        runner = self.runner
        heads, _, head_dim = q.shape
        compute = self.compute_dtype or q.dtype
        q_rows = q.reshape(1, runner.num_kv_heads, heads // runner.num_kv_heads, head_dim).to(compute)
        keys, values = pool.keys[layer], pool.values[layer]  # [kv_heads, slots, head_dim]
        return [_flash_cpu(q_rows, keys[None, :, a:b].to(compute), values[None, :, a:b].to(compute),
                           scale=runner.scale) for a, b in runs]

    def _merge_runs(self, parts) -> torch.Tensor:
        """The runs' outputs of every stitched session, each weighted by its share of the session's softmax mass
        (exp(lse_run - lse_session)), as flash-decoding merges its key splits, all sessions at once: [stitched
        sessions, heads * head_dim] in float32 (float64 for a float64 model)."""
        out = torch.cat([o for o, _ in parts])  # [runs, kv_heads, groups, head_dim]
        lse = torch.cat([lse for _, lse in parts])  # [runs, kv_heads, groups]
        out, lse = (t.to(torch.promote_types(out.dtype, torch.float32)) for t in (out, lse))  # float64 stays
        owner, sessions = self.run_owner, int(self.run_owner[-1]) + 1
        top = lse.new_full((sessions, *lse.shape[1:]), -torch.inf)
        top.scatter_reduce_(0, owner[:, None, None].expand_as(lse), lse, "amax")
        weight = (lse - top[owner]).exp_()  # [runs, kv_heads, groups]
        total = lse.new_zeros(top.shape).index_add_(0, owner, weight)
        merged = out.new_zeros(sessions, *out.shape[1:]).index_add_(0, owner, out.mul_(weight.unsqueeze(-1)))
        return merged.div_(total.unsqueeze(-1)).reshape(sessions, -1)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel: (out, log-sum-exp)

# A stitched table's decode row reads its keys and values in place, run by run, or gathers them into one copy
# (``_SdpaAttention``). The gather copies the session's context every layer of every step; reading in place adds
# a call per run and one merge a layer for all such sessions (~12 small operations: 70-130 µs alone on the
# project's AVX2 VM, 0.3-0.5 ms a step of the 1-layer model at one request). Measured there (one decode row per
# session, two runs each, float32, µs per session): a session alone gathers faster up to ~4 MiB of keys and values
# (the pair's target at 544 positions: 318 against 453; at 1,024: a tie), while 16-64 sessions read in place faster
# from ~1 MiB (at 2.2 MiB each: 460 / 1,146 against 375 / 383 at 16 / 64; the Xeon's 64 sessions at ~500
# positions: 1.46x the forward, cpu_xeon.md section 4); below 1 MiB the gather is as fast or faster at every count.
IN_PLACE_MIN_BYTES = 1 << 20  # a session's keys + values a layer from which reading in place can pay
IN_PLACE_ALONE_BYTES = 4 << 20  # ... from which it pays without other sessions sharing the merge
IN_PLACE_SHARED = 4  # sessions of IN_PLACE_MIN_BYTES+ that share the merge enough


def in_place_sessions(context_bytes: Sequence[int]) -> list[bool]:
    """Which of a forward's stitched decode rows (their keys + values per layer, bytes) read in place rather than
    gather their table: past IN_PLACE_ALONE_BYTES always, past IN_PLACE_MIN_BYTES where IN_PLACE_SHARED or more
    of them do, so that the merge's fixed cost is shared."""
    large = [b >= IN_PLACE_MIN_BYTES for b in context_bytes]
    if sum(large) >= IN_PLACE_SHARED:
        return large
    return [b >= IN_PLACE_ALONE_BYTES for b in context_bytes]


@dataclass
class KernelMetadata:
    """A step's tree-attention metadata on the host (``kernels.tree_attention``'s arguments), for B sessions and
    T packed rows: where the keys live and which rows see which columns."""

    keys: torch.Tensor  # the storage read: a pool's or one FastKVCache's [layers, kv_heads, slots, head_dim]
    values: torch.Tensor
    block_size: int
    cu_q: np.ndarray  # [B + 1] row offsets
    kv_len: np.ndarray  # [B] positions after the step
    tree_start: np.ndarray  # [B] first tree column (kv_len: causal)
    tables: np.ndarray  # [B, blocks] block tables, each cut to its blocks in use (zeros after)
    slots: np.ndarray  # [T] the slot each new row writes
    words: np.ndarray  # [T, W] ancestor bits of the tree rows (zeros elsewhere; W = 0 without a tree)
    has_tree: bool


def kernel_metadata(runner: FastLlamaRunner, caches, num_new: Sequence[int], attends) -> KernelMetadata:
    """The step's metadata for sessions ``caches`` (one pool's PagedKVCaches, or one FastKVCache read as one block)
    appending ``num_new`` rows under ``attends`` (TreeMask or None = causal); ValueError for a node that attends to
    a later node."""
    if isinstance(caches[0], PagedKVCache):
        keys, values, block_size = caches[0].pool.keys, caches[0].pool.values, caches[0].pool.block_size
        tables = [np.asarray(c.table, np.int64) for c in caches]
    else:  # one contiguous session: one block spanning its capacity
        keys, values, block_size = caches[0].keys, caches[0].values, caches[0].keys.shape[2]
        tables = [np.zeros(1, np.int64)]
    ends = [c.length + n for c, n in zip(caches, num_new, strict=True)]
    num_blocks = max(-(-end // block_size) for end in ends)
    table_rows = np.zeros((len(caches), num_blocks), np.int64)
    slots, tree_start, masks = [], [], []
    for r, (cache, n, attend, end) in enumerate(zip(caches, num_new, attends, ends, strict=True)):
        used = tables[r][: -(-end // block_size)]
        table_rows[r, : len(used)] = used
        positions = np.arange(cache.length, end)
        slots.append(tables[r][positions // block_size] * block_size + positions % block_size)
        if attend is None:
            tree_start.append(end)  # causal: no tree columns
            continue
        assert attend.shape == (n, end), (attend.shape, cache.length, n)
        ancestors = attend.ancestors.cpu()  # host sync only if a caller built its tree on the device
        if torch.triu(ancestors[:, ancestors.shape[1] - n :], diagonal=1).any():
            raise ValueError("a tree node attends to a later node: nodes must come after their ancestors")
        tree_start.append(attend.prefix_len)
        masks.append((r, runner._kernels.pack_tree_mask(ancestors).numpy()))
    cu_q = np.cumsum([0, *num_new])
    words = np.zeros((int(cu_q[-1]), max((m.shape[1] for _, m in masks), default=0)), np.int64)
    for r, bits in masks:
        words[cu_q[r] : cu_q[r + 1], : bits.shape[1]] = bits
    return KernelMetadata(keys, values, block_size, cu_q, np.asarray(ends), np.asarray(tree_start), table_rows,
                          np.concatenate(slots), words, bool(masks))


class _KernelAttention:
    """Every session in one tree-attention launch per layer: the new keys/values of all sessions written with
    one scatter, then read back with the prefix through the block tables. The step's metadata (row offsets,
    lengths, tables, slots, ancestor bits) is built on the host and crosses to the device in one copy."""

    @staticmethod
    def applies(caches, attends) -> bool:
        if any(isinstance(a, torch.Tensor) for a in attends):
            return False  # a dense mask has no tree structure to pass
        if all(isinstance(c, PagedKVCache) for c in caches):
            return len({id(c.pool) for c in caches}) == 1
        return len(caches) == 1 and isinstance(caches[0], FastKVCache)

    def __init__(self, runner: FastLlamaRunner, meta: KernelMetadata, num_new: Sequence[int]) -> None:
        self.runner, self.total = runner, sum(num_new)
        self.keys, self.values, self.block_size = meta.keys, meta.values, meta.block_size
        parts = [meta.cu_q, meta.kv_len, meta.tree_start, meta.tables.reshape(-1), meta.slots, meta.words.reshape(-1)]
        # each part starts on a 16-byte boundary: the kernel is compiled per pointer alignment (kernels/)
        spans = [-(-len(p) // ALIGN_INT32) * ALIGN_INT32 for p in parts]
        host = np.zeros(sum(spans), np.int32)
        for part, at in zip(parts, np.cumsum([0, *spans[:-1]]), strict=True):
            host[at : at + len(part)] = part
        device = torch.from_numpy(host).to(runner.device, non_blocking=True)  # one host->device copy, no wait
        pieces = [piece[: len(p)] for piece, p in zip(device.split(spans), parts, strict=True)]
        self.cu_q, self.kv_len, self.tree_start = pieces[:3]
        self.tables = pieces[3].view(meta.tables.shape)
        self.slots = pieces[4].long()
        self.mask = pieces[5].view(meta.words.shape) if meta.has_tree else None
        self.max_num_new = max(num_new)
        self.splits = runner._kv_splits(self.max_num_new, len(num_new), int(meta.kv_len.max()))

    @classmethod
    def of(cls, runner: FastLlamaRunner, keys, values, block_size: int, cu_q, kv_len, tree_start, tables, slots, mask,
           max_num_new: int, splits: int = 1) -> _KernelAttention:
        """An attention over metadata already on the device (a CUDA graph's static buffers: cuda_graphs.py)."""
        self = cls.__new__(cls)
        self.runner, self.total = runner, slots.shape[0]
        self.keys, self.values, self.block_size = keys, values, block_size
        self.cu_q, self.kv_len, self.tree_start, self.tables = cu_q, kv_len, tree_start, tables
        self.slots, self.mask, self.max_num_new, self.splits = slots, mask, max_num_new, splits
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [heads, T, head_dim]; k/v: [kv_heads, T, head_dim] -> [T, heads * head_dim]."""
        keys, values = self.keys[layer], self.values[layer]  # [kv_heads, slots, head_dim]
        keys.index_copy_(1, self.slots, k)
        values.index_copy_(1, self.slots, v)
        out = self.runner._kernels.tree_attention(
            q.transpose(0, 1), keys, values, self.cu_q, self.kv_len, self.tree_start, self.tables, self.block_size,
            self.mask, max_num_new=self.max_num_new, scale=self.runner.scale, kv_splits=self.splits,
        )  # [T, heads, head_dim], contiguous
        return out.view(self.total, self.runner.q_size)


def attention_backend(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve ``choice`` (one of ATTENTION_BACKENDS) to ``sdpa`` or ``triton``: ``auto`` is $SPECMESH_ATTENTION
    when set, else the kernel for a CUDA model in a dtype it takes, when triton imports, else SDPA."""
    if choice == "auto":
        choice = os.environ.get(ATTENTION_ENV) or "auto"
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}; choose one of {ATTENTION_BACKENDS}")
    if choice != "auto":
        return choice
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not _cuda_with_triton(device):
        return "sdpa"
    return "triton"


def _cuda_with_triton(device: torch.device) -> bool:
    """A CUDA device, and triton imports (the kernel's and inductor's GPU code generator)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compile_choice(choice: str, device: torch.device) -> str:
    """Resolve ``compile_layers`` (one of COMPILE_MODES) to ``off``, ``on`` or ``frozen``. ``auto`` is
    $SPECMESH_COMPILE when set, else ``on`` for a CUDA model when triton imports (a layer's ~30 eager launches become
    ~10, and on a GPU the host's launches bound the step: benchmarks/results/gpu_h100.md) and ``off`` on the CPU
    (``on`` measured 0.86-0.97x there: hot_path.md; ``frozen`` pays there but compiles for minutes at start-up).
    ``frozen`` (the whole stack as one graph, weights as constants: ``_FrozenStack``) is the CPU's mode."""
    if choice == "auto":
        choice = os.environ.get(COMPILE_ENV) or "auto"
    if choice not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {choice!r}; choose one of {COMPILE_MODES}")
    if choice == "frozen" and device.type != "cpu":
        raise ValueError("compile mode 'frozen' is for a CPU model (inductor's C++ GEMM templates); on CUDA use 'on'")
    if choice != "auto":
        return choice
    return "on" if _cuda_with_triton(device) else "off"


# ------------------------------------------------------------------------------ the frozen stack (--compile frozen)
# On a CPU the step's few rows go through MKL's small-M GEMM, which runs near one row's speed per row (2 rows ~1.5x
# one, 4 rows ~2.3x): a verify step's tree costs almost a forward per few nodes. Inductor's C++ GEMM templates
# (max-autotune) run 2-16 rows at 1.3-1.6x that speed, but only on weights frozen into the graph as constants
# (they are packed at compile time): so the whole stack is one compiled module that owns its weights, and each
# layer's attention (paged writes, the step's masks: state the compiler must not see) is an opaque custom op
# that calls the forward's attention object, handed over per thread.
_FROZEN = threading.local()  # .attention: the attention of the frozen-stack forward running on this thread
_LAYER_FIELDS = ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up", "down")  # a layer tuple's order
FROZEN_OPTIONS = {  # inductor options of the frozen stack
    "freezing": True,  # weights become constants, packed for the GEMM templates
    "max_autotune": True,  # benchmark the C++ templates against ATen's GEMM per shape, at compile time
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,  # no autotuning tables on stderr
    "max_autotune_report_choices_stats": False,
}


@torch.library.custom_op("specmesh::layer_attention", mutates_args=())
def _layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [heads, T, head_dim], k/v [kv_heads, T, head_dim] -> [T, heads * head_dim]: layer ``layer``'s attention by
    the forward's own attention object (``_FROZEN.attention``), which also writes k and v into the caches."""
    return _FROZEN.attention(layer, q, k, v)


@_layer_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2])


class _LayerWeights(torch.nn.Module):
    """One layer's weights as parameters (views of the runner's; None where a bias is absent)."""

    def __init__(self, weights: Sequence[torch.Tensor | None]) -> None:
        super().__init__()
        for name, weight in zip(_LAYER_FIELDS, weights, strict=True):
            self.register_parameter(name, None if weight is None else torch.nn.Parameter(weight, requires_grad=False))


class _FrozenStack(torch.nn.Module):
    """Every layer of the runner over rows x [T, hidden] (embedded) with rotary tables cos/sin [T, head_dim] ->
    the last layer's output [T, hidden], attention through ``_layer_attention``."""

    def __init__(self, runner: FastLlamaRunner) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_LayerWeights(layer) for layer in runner.layers)
        self.shape = (runner.num_heads, runner.num_kv_heads, runner.head_dim)
        self.eps = runner.eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(self.layers):
            q, k, v = _pre_attention(x, w.ln1, w.qkv_w, w.qkv_b, cos, sin, self.eps, *self.shape)
            x = _post_attention(x, _layer_attention(q, k, v, i), w.o_w, w.o_b, w.ln2, w.gate_up, w.down, self.eps)
        return x


# ------------------------------------------------------------------------------------- runner
class FastLlamaRunner(ModelRunner):
    """The fast forward over a Llama-family model: built on a loaded transformers module (``FastLlamaRunner(model)``,
    whose parameters become views of the runner's weights) or straight from a checkpoint directory
    (``from_checkpoint``: no transformers import, ``self.model`` is None)."""

    def __init__(self, model: PreTrainedModel, attention: str = "auto", compile_layers: str = "auto",
                 cuda_graphs: str = "auto") -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the fast runner cannot run this model: {reason}")
        super().__init__(model)
        cfg = model.config
        inner = model.model
        # The runner's own layout of the weights ([in, out], fused QKV and gate/up) is the only copy kept: the
        # HF module's parameters become views into it (``_share``), so its forward (the HF peers of `bench`)
        # still runs, on the same numbers, without a second copy of the model in memory. (In float32 on a CPU
        # the output layer has one more copy, in column blocks: ``head_blocks``.)
        head = model.get_output_embeddings()
        tied = head.weight is inner.embed_tokens.weight
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            projections = (att.q_proj, att.k_proj, att.v_proj)
            qkv_w = in_out_layout(torch.cat([p.weight for p in projections]))
            qkv_b = None
            if att.q_proj.bias is not None:
                qkv_b = torch.cat([p.bias for p in projections]).detach().contiguous()
            gate_up = in_out_layout(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            o_w, down = in_out_layout(att.o_proj.weight), in_out_layout(mlp.down_proj.weight)
            _share(projections, qkv_w, qkv_b)
            _share((mlp.gate_proj, mlp.up_proj), gate_up)
            _share((att.o_proj,), o_w)
            _share((mlp.down_proj,), down)
            self.layers.append((layer.input_layernorm.weight, qkv_w, qkv_b, o_w, att.o_proj.bias,
                                layer.post_attention_layernorm.weight, gate_up, down))
        self.norm = inner.norm.weight
        self.lm_head = in_out_layout(head.weight)  # [hidden, vocab]
        self.lm_head_bias = getattr(head, "bias", None)
        _share((head,), self.lm_head)
        # tied embeddings: the table is the output layer's, read by column ([hidden, vocab]); else its own rows
        self.embed = None if tied else inner.embed_tokens.weight  # [vocab, hidden]
        if tied:
            inner.embed_tokens.weight = head.weight
        with torch.inference_mode():
            positions = torch.arange(self.info.max_positions, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)  # [1, max_positions, head_dim]
        self._setup(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None),
                    getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.rms_norm_eps,
                    cos[0], sin[0], attention, compile_layers, cuda_graphs)

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        attention: str = "auto", compile_layers: str = "auto",
                        cuda_graphs: str = "auto") -> FastLlamaRunner:
        """The runner over the checkpoint in ``path`` read without transformers: config.json and safetensors,
        exactly the weights and rotary tables transformers would load (``checkpoint.fast_reason`` must be
        None, else ValueError with the reason). ``self.model`` is None: there is no transformers module."""
        path = Path(path)
        reason = checkpoint.fast_reason(path)
        if reason is not None:
            raise ValueError(f"{path} cannot be read without transformers: {reason}")
        device = torch.device(device)
        cfg = checkpoint.read_config(path)
        tensors = checkpoint.load_tensors(path, dtype, device)
        self = cls.__new__(cls)  # the ModelRunner fields without a module (ModelRunner.__init__ reads one)
        self.model, self.dtype, self.device = None, dtype, device
        eos = cfg["eos_token_id"] if cfg["eos_token_id"] is not None else ()
        embed = tensors.pop("model.embed_tokens.weight")  # [vocab, hidden]
        head = embed if cfg["tie_word_embeddings"] else tensors.pop("lm_head.weight")
        self.info = ModelInfo(vocab_size=int(head.shape[0]), max_positions=int(cfg["max_position_embeddings"]),
                              eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos))
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            def take(name: str, layer: str = f"model.layers.{i}.") -> torch.Tensor | None:
                """A tensor of this layer, let go of by the dict as it is fused (the peak stays one layer's)."""
                return tensors.pop(layer + name, None)

            att = [f"self_attn.{p}_proj" for p in "qkv"]
            biases = [take(p + ".bias") for p in att]
            self.layers.append((take("input_layernorm.weight"), in_out_layout(torch.cat([take(p + ".weight") for p in att])),
                                None if biases[0] is None else torch.cat(biases),
                                in_out_layout(take("self_attn.o_proj.weight")), take("self_attn.o_proj.bias"),
                                take("post_attention_layernorm.weight"),
                                in_out_layout(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])),
                                in_out_layout(take("mlp.down_proj.weight"))))
        self.norm = tensors["model.norm.weight"]
        self.lm_head, self.lm_head_bias = in_out_layout(head), None  # [hidden, vocab]
        self.embed = None if cfg["tie_word_embeddings"] else embed
        del embed, head  # the fused copies are kept; every layer's tensor has left ``tensors`` already
        with torch.inference_mode():
            cos, sin = checkpoint.rope_tables(cfg, dtype, device)
        self._setup(cfg["num_attention_heads"], cfg.get("num_key_value_heads"), checkpoint.head_dim(cfg),
                    cfg["rms_norm_eps"], cos, sin, attention, compile_layers, cuda_graphs)
        return self

    def _setup(self, num_heads: int, num_kv_heads: int | None, head_dim: int, eps: float, cos: torch.Tensor,
               sin: torch.Tensor, attention: str, compile_layers: str = "auto", cuda_graphs: str = "auto") -> None:
        """What both constructors share, once the weights are in place; cos/sin: [max_positions, head_dim]."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim
        self.eps = eps
        self.cos, self.sin = cos, sin
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.attention = attention_backend(attention, self.device, self.dtype)
        # the output layer in column blocks, for products of 2+ rows (a verify step's trees, a batch): float32 on
        # a CPU only, where it was measured to pay (one more copy of the output layer's weights)
        cpu_float32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.head_blocks = head_blocks(self.lm_head, HEAD_BLOCK) if cpu_float32 else None
        mode = compile_choice(compile_layers, self.device)
        # bf16 products on oneDNN-packed weights where the CPU multiplies bf16 natively (``_PACKED``); not under
        # --compile frozen, whose stack packs its own
        weights = [w for _, qkv_w, _, o_w, _, _, gate_up, down in self.layers for w in (qkv_w, o_w, gate_up, down)]
        self.packed = mode != "frozen" and _packs_products(self.device, self.dtype) and pack_weights(
            weights + [self.lm_head])
        # float32 copies of the layers' and the output layer's weights where some products run through float32
        # (``_FLOAT32``); not under --compile on, whose compiled layers multiply in the weights' own dtype
        self.float32_copies = mode != "on" and _upcasts_products(self.device, self.dtype) and keep_float32_copies(
            weights + [self.lm_head])
        self._kernels = self._load_kernels() if self.attention == "triton" else None
        if self._kernels is not None and self.device.type == "cuda":
            t0 = time.perf_counter()
            n = self._kernels.compile_variants(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device)
            log.info("tree-attention kernel: %d variants compiled in %.1f s", n, time.perf_counter() - t0)
        # split-KV when a launch has fewer programs than the GPU has SMs (kernels.tree_attention.kv_splits)
        self._num_sms = None
        if self._kernels is not None and self.device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._dense = (_pre_attention, _post_attention)  # a layer's work before and after attention
        self._stack = None  # the compiled frozen stack (--compile frozen), which then runs every layer
        if mode == "on":
            self._dense = self._compiled_dense(required=compile_layers == "on")
        # CUDA graphs of the kernel path's steps, per paged pool (cuda_graphs.py): "on", "auto" or None (off)
        self._graph_mode = graph_choice(cuda_graphs, self.device, self.attention)
        self._pool_graphs = weakref.WeakKeyDictionary()  # KVPool -> PoolGraphs
        if mode == "frozen":
            self._stack = self._compiled_stack(required=compile_layers == "frozen")

    @property
    def _frozen_rows(self) -> int:
        """The most rows of a step that the frozen stack runs: every step in float32 and off the CPU; in half
        precision on a CPU, the steps below those whose products go through float32 (``_linear``), where the
        eager layers beat the stack's half-precision GEMMs: FROZEN_HALF_MAX_ROWS without native support,
        NATIVE_BF16_UPCAST_ROWS - 1 with AVX-512-BF16 alone."""
        if self.device.type != "cpu":
            return _NEVER
        if self.dtype in _UPCAST_DTYPES:
            return FROZEN_HALF_MAX_ROWS
        return _NATIVE_UPCAST_ROWS.get(self.dtype, _NEVER + 1) - 1

    def _kv_splits(self, max_num_new: int, num_requests: int, longest: int) -> int:
        """Programs sharing each tile's keys in this step's kernel launches (1 off CUDA)."""
        if self._num_sms is None:
            return 1
        kernels = self._kernels
        programs = kernels.num_programs(self.num_heads, self.num_kv_heads, max_num_new, self.head_dim, num_requests)
        return kernels.kv_splits(programs, longest, self._num_sms)

    @property
    def compiled(self) -> bool:
        """Whether the layers run torch.compiled (``compile_layers``, after the start-up check)."""
        return self._dense != (_pre_attention, _post_attention) or self._stack is not None

    @torch.inference_mode()
    def _compiled_dense(self, required: bool):
        """``torch.compile``d ``_pre_attention`` and ``_post_attention``, compiled now on a probe through the first
        layer (one row, its own specialisation, and three rows, the dynamic graph every other row count reuses), and
        held to the eager functions there. A failure or a mismatch raises where compiling was asked for (``on``)
        and otherwise leaves the layers eager, with a warning (``auto``)."""
        t0 = time.perf_counter()
        compiled = tuple(torch.compile(f, dynamic=True, fullgraph=True) for f in (_pre_attention, _post_attention))
        ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down = self.layers[0]
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        generator = torch.Generator(self.device).manual_seed(0)
        try:
            for rows in (1, 3):
                x = torch.randn(rows, qkv_w.shape[0], generator=generator, device=self.device).to(self.dtype)
                attn = torch.randn(rows, self.q_size, generator=generator, device=self.device).to(self.dtype)
                pre_args = (x, ln1, qkv_w, qkv_b, self.cos[:rows], self.sin[:rows], self.eps, *shape)
                post_args = (x, attn, o_w, o_b, ln2, gate_up, down, self.eps)
                for fn, eager, args in zip(compiled, (_pre_attention, _post_attention), (pre_args, post_args), strict=True):
                    got, want = fn(*args), eager(*args)
                    for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)), strict=True):
                        error = relative_error(a, b) if a.shape == b.shape else float("inf")
                        if not error <= COMPILE_TOLERANCE[self.dtype]:
                            raise ValueError(f"{eager.__name__} compiled differs from eager at {rows} rows: "
                                             f"{tuple(a.shape)} vs {tuple(b.shape)}, relative error {error:.2g}")
        except Exception as exc:  # inductor's failures have many types; the eager layers stay right
            if required:
                raise
            log.warning("torch.compile of the layers failed, they run eager: %s", exc)
            return _pre_attention, _post_attention
        log.info("layers compiled (torch.compile, dynamic rows) in %.1f s", time.perf_counter() - t0)
        return compiled

    @torch.inference_mode()
    def _compiled_stack(self, required: bool):
        """The frozen stack (``_FrozenStack``) ``torch.compile``d under ``FROZEN_OPTIONS``, compiled now on a probe
        session (an 8-token prefill, then one row, its own specialisation, and three rows, the dynamic graph every
        other row count reuses; minutes for a real model, most of it autotuning) and held to the eager layers there.
        A failure or a mismatch raises where it was asked for (``frozen``) and otherwise leaves the layers eager,
        with a warning (``auto`` through $SPECMESH_COMPILE)."""
        import torch._inductor.config as inductor_config  # loaded with torch.compile's backend, not with torch

        t0 = time.perf_counter()
        stack = torch.compile(_FrozenStack(self), dynamic=True)
        ids = torch.randint(0, self.info.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        caches = (self.new_cache(), self.new_cache())
        try:  # inductor's global config, patched while the probe compiles (``torch.compile(options=)`` did not
            # freeze: measured 0.96x of eager instead of 0.6-0.8x at 2-8 rows)
            with inductor_config.patch(FROZEN_OPTIONS):
                self._probe_stack(stack, caches, ids)
        except Exception as exc:  # inductor's failures have many types; the eager layers stay right
            if required:
                raise
            log.warning("torch.compile of the frozen stack failed, the layers run eager: %s", exc)
            return None
        log.info("layer stack compiled frozen (torch.compile, max-autotune C++ GEMMs, dynamic rows) in %.1f s",
                 time.perf_counter() - t0)
        return stack

    def _probe_stack(self, stack, caches: tuple[FastKVCache, FastKVCache], ids: list[int]) -> None:
        """Run ``ids`` through the eager layers (caches[0]) and ``stack`` (caches[1]) as an 8-row prefill, one row
        and three rows, comparing the logits: ValueError beyond COMPILE_TOLERANCE."""
        for start, end in ((0, 8), (8, 9), (9, 12)):
            args = (ids[start:end], list(range(start, end)), [end - start], [None])
            want = self.forward_batch([caches[0]], *args)
            self._stack = stack
            try:
                got = self.forward_batch([caches[1]], *args)
            finally:
                self._stack = None
            error = relative_error(got, want)
            if not error <= COMPILE_TOLERANCE[self.dtype]:
                raise ValueError(f"the frozen stack differs from eager at {end - start} rows: relative error {error:.2g}")

    def _load_kernels(self):
        """kernels.tree_attention, imported only for the triton backend (a CPU install needs no triton)."""
        try:
            from kernels import tree_attention
        except ImportError as exc:
            raise ValueError(f"the triton attention backend needs triton: {exc}") from exc
        if self.dtype not in tree_attention.SUPPORTED_DTYPES or self.head_dim > tree_attention.MAX_HEAD_DIM:
            raise ValueError(f"the tree-attention kernel takes {tree_attention.SUPPORTED_DTYPES} and head_dim <= "
                             f"{tree_attention.MAX_HEAD_DIM}, not {self.dtype} / {self.head_dim}")
        if self.device.type != "cuda" and not tree_attention.INTERPRETED:
            raise ValueError("the tree-attention kernel runs on CUDA, or on the CPU under the Triton interpreter "
                             "(TRITON_INTERPRET=1 before kernels.tree_attention is imported)")
        return tree_attention

    def new_cache(self) -> FastKVCache:
        return FastKVCache(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device, self.info.max_positions)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] -> [n, hidden] input embeddings."""
        if self.embed is not None:
            return self.embed[ids]
        # tied: the output layer's columns. Gather along its contiguous dimension: in a contiguous [hidden, vocab]
        # (float32) a gather along its rows, ~1 ms per 2000 tokens on the stdlib target, where reading the
        # transposed view row by row takes 7; in a transposed view of [vocab, hidden] (bf16/fp16 on a CPU) the
        # rows of that matrix (index_select along the view's dim 1 copies the whole matrix first: 57 ms a call
        # for SmolLM2's 49,152 x 576 in bf16)
        if self.lm_head.stride(0) == 1:
            return self.lm_head.t().index_select(0, ids)
        return self.lm_head.index_select(1, ids).t().contiguous()

    def _to_device(self, values: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[n] long on the runner's device: host data crosses without waiting for the device; a tensor already
        there (drafted tokens) is used as it is."""
        if isinstance(values, torch.Tensor) and values.device.type == torch.device(self.device).type:
            return values.long().reshape(-1)
        return torch.as_tensor(values, dtype=torch.long).to(self.device, non_blocking=True).reshape(-1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms(x, weight, self.eps)

    def forward(
        self,
        cache: FastKVCache | PagedKVCache,
        input_ids: Sequence[int] | torch.Tensor,  # [num_new]
        position_ids: Sequence[int] | torch.Tensor,  # [num_new]
        attend: torch.Tensor | TreeMask | None = None,  # [num_new, cache.length + num_new] bool, or None = causal
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append ``input_ids`` to ``cache``; return their logits, [num_new, vocab] float32
        (``last_only``: the last token's, [1, vocab]; a prefill skips the output layer for the rest)."""
        num_new = len(input_ids)
        rows = slice(num_new - 1, num_new) if last_only else None
        return self.forward_batch([cache], input_ids, position_ids, [num_new], [attend], rows)

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: Sequence[FastKVCache | PagedKVCache],
        input_ids: Sequence[int] | torch.Tensor,  # [T]: the new tokens of every request, packed
        position_ids: Sequence[int] | torch.Tensor,  # [T]
        num_new: Sequence[int],  # [B]: request r owns rows cu[r]:cu[r + 1], cu = cumsum([0] + num_new)
        attends: Sequence[torch.Tensor | TreeMask | None],  # [B]: [num_new[r], caches[r].length + num_new[r]]
        logit_rows: torch.Tensor | slice | None = None,  # packed rows whose logits are wanted (None = all)
        hidden_rows: torch.Tensor | None = None,  # packed rows whose final-layer features are wanted (None = none)
        *,
        eager: bool = False,  # never replay a CUDA graph (the graphs' own start-up check)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward over the new tokens of B sessions: the projections and the MLP run on all T rows at
        once, attention per session on its own keys (its prefix in its cache + its new rows, under its mask:
        None = causal). Appends each session's rows to its cache; returns the logits of ``logit_rows``,
        [R, vocab] float32. With ``hidden_rows``: (logits, features [len(hidden_rows), hidden] in the model's
        dtype), the features being the final norm's output (what the LM head reads; Falcon heads draft on them)."""
        ids, pos = self._to_device(input_ids), self._to_device(position_ids)
        total = ids.shape[0]
        assert sum(num_new) == total and len(caches) == len(num_new) == len(attends), (total, num_new)
        for cache, n in zip(caches, num_new, strict=True):
            cache.reserve(cache.length + n)
        meta = None  # the kernel path's metadata, built once for a graph replay or the eager launches
        if self._kernels is not None and _KernelAttention.applies(caches, attends):
            meta = kernel_metadata(self, caches, num_new, attends)
        graphs = None
        if meta is not None and hidden_rows is None and not eager and isinstance(caches[0], PagedKVCache):
            graphs = self.pool_graphs(caches[0].pool)
        if graphs is not None and (logits := graphs.forward(meta, ids, pos, num_new)) is not None:
            for cache, n in zip(caches, num_new, strict=True):
                cache.length += n
            return logits if logit_rows is None else logits[logit_rows]
        if meta is not None:
            attention = _KernelAttention(self, meta, num_new)
        else:
            attention = _SdpaAttention(self, caches, num_new, attends)
        logits, features = self._layers(ids, pos, attention, logit_rows, hidden_rows)
        for cache, n in zip(caches, num_new, strict=True):
            cache.length += n
        return logits if features is None else (logits, features)

    def forward_eager(self, cache, input_ids: Sequence[int], position_ids: Sequence[int]) -> torch.Tensor:
        """``forward`` without CUDA graphs: [num_new, vocab] float32."""
        return self.forward_batch([cache], input_ids, position_ids, [len(input_ids)], [None], eager=True)

    @property
    def cuda_graphs(self) -> str:
        """``on``, ``auto`` or ``off``: the CUDA-graph mode in force (``auto`` turns ``off`` if a check fails)."""
        return self._graph_mode or "off"

    @property
    def graph_replays(self) -> int:
        """Steps served by CUDA graphs (or their static-buffer path off CUDA) so far, over every pool."""
        return sum(graphs.replays for graphs in self._pool_graphs.values())

    def graph_stats(self) -> dict[str, float]:
        """Over every pool so far: ``replays`` (steps served by a graph), ``eager`` (steps that fit no bucket),
        ``captures`` (buckets captured, the start-up ones included) and ``capture_seconds`` (their time)."""
        pools = list(self._pool_graphs.values())
        return {name: sum(getattr(graphs, name) for graphs in pools)
                for name in ("replays", "eager", "captures", "capture_seconds")}

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, attention, logit_rows=None, hidden_rows=None):
        """The stack over packed rows ids/pos [T] with ``attention`` (its caches already hold the step's blocks):
        (logits of ``logit_rows`` [R, vocab] float32, final-norm features of ``hidden_rows`` or None). Pure device
        work: what a CUDA graph captures (cuda_graphs.py)."""
        cos, sin = self.cos[pos], self.sin[pos]
        x = self._embed(ids)  # [T, hidden]
        if self._stack is not None and x.shape[0] <= self._frozen_rows:
            _FROZEN.attention = attention
            try:
                x = self._stack(x, cos, sin)
            finally:
                _FROZEN.attention = None
        else:
            pre, post = self._dense
            for i, (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down) in enumerate(self.layers):
                q, k, v = pre(x, ln1, qkv_w, qkv_b, cos, sin, self.eps, self.num_heads, self.num_kv_heads,
                              self.head_dim)
                x = post(x, attention(i, q, k, v), o_w, o_b, ln2, gate_up, down, self.eps)
        features = None if hidden_rows is None else self._rms(x[hidden_rows], self.norm)
        if logit_rows is not None:
            x = x[logit_rows]
        return self._logits(self._rms(x, self.norm)), features

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-norm features x [n, hidden] -> logits [n, vocab] float32: the blocked copy of the output layer
        for 2+ rows where there is one, else ``lm_head`` (at one row its contiguous [hidden, vocab] is fastest)."""
        if self.head_blocks is None or x.shape[0] < 2:
            return _linear(x, self.lm_head, self.lm_head_bias).float()
        logits = blocked_product(x, self.head_blocks, self.lm_head.shape[1])
        return (logits if self.lm_head_bias is None else logits + self.lm_head_bias).float()

    def pool_graphs(self, pool: KVPool) -> PoolGraphs | None:
        """The pool's CUDA graphs, created (checked against eager on a probe session, the decode buckets captured) on
        first call: a verifier calls it when it builds its pool, so both happen at start-up. None with graphs off or
        when the check failed under ``auto`` (every step then runs eager)."""
        if not self._graph_mode or self._kernels is None:
            return None
        graphs = self._pool_graphs.get(pool)
        if graphs is None:
            graphs = PoolGraphs(self, pool, capture=self.device.type == "cuda", required=self._graph_mode == "on")
            if not graphs.check():
                self._graph_mode = None  # the check failed under auto: eager from now on (it said why)
                return None
            graphs.warm()  # every plain-decoding bucket now: no decode step pays a capture mid-serving
            self._pool_graphs[pool] = graphs
        return graphs

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVPool:
        """A paged KV pool for this model's sessions (``PagedKVCache``s from ``pool.open``)."""
        return KVPool(len(self.layers), self.num_kv_heads, self.head_dim, num_blocks, block_size, self.dtype,
                      self.device)

    @property
    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype)


def make_runner(model: PreTrainedModel, backend: str = "auto", attention: str = "auto",
                compile_layers: str = "auto", cuda_graphs: str = "auto") -> ModelRunner:
    """``auto``: the fast runner where it applies, else Hugging Face; ``hf`` / ``fast`` force one.
    ``attention``: the fast runner's attention backend (ATTENTION_BACKENDS); ``compile_layers``: whether it
    torch.compiles its layers (COMPILE_MODES, ``compile_choice``); ``cuda_graphs``: whether it replays its kernel
    steps as CUDA graphs (GRAPH_MODES, ``cuda_graphs.graph_choice``)."""
    if backend == "hf":
        return ModelRunner(model)
    if backend == "fast" or (backend == "auto" and supports(model) is None):
        return FastLlamaRunner(model, attention, compile_layers, cuda_graphs)
    if backend != "auto":
        raise ValueError(f"unknown runner backend {backend!r}; choose auto, hf or fast")
    return ModelRunner(model)


__all__ = ["ATTENTION_BACKENDS", "COMPILE_MODES", "FastLlamaRunner", "FastKVCache", "attention_backend", "blocked_product",
           "compile_choice", "head_blocks", "in_out_layout", "make_runner", "supports"]
