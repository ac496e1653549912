"""The fast runner on a CPU: the weight layouts and matrix products that run fastest there, by dtype and by what
the CPU multiplies natively (AVX-512-BF16, AMX: ``runner_options.cpu_flags``).

- Layouts: ``in_out_layout`` (a layer's [in, out] weight as the dtype's fastest product reads it) and, in float32,
  the output layer in contiguous column blocks (``head_blocks``, ``blocked_product``).
- ``linear``, every product of the layers and the output layer: through float32 where the half-precision kernel
  is slower (``_linear_upcast``: by the weight's float32 copy, ``keep_float32_copies``, or the weight converted a
  block at a time), on oneDNN-packed bf16 weights where the CPU multiplies bf16 natively (``pack_weights``), else
  torch's own product (always off the CPU, and while torch.compile traces).
- What the same measurements decide elsewhere: the dtype of a decode row's attention (``decode_attention_dtype``)
  and the steps the frozen stack runs (``frozen_max_rows``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

from specmesh.runner_options import cpu_flags, cpu_has_fast_bf16

HEAD_BLOCK = 4096  # columns per block of the output layer's blocked copy (``head_blocks``; 2,048-8,192 measure alike)


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


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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


def packs_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products of a model on ``device`` in ``dtype`` run on oneDNN-packed weights (see ``_PACKED``)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_fast_bf16()
            and torch.backends.mkldnn.is_available())


def pack_weights(weights: Sequence[torch.Tensor], memory_bytes: int | None = None) -> bool:
    """Give each of ``weights`` (CPU bf16, [in, out] views of [out, in] storage) its oneDNN-packed copy (``linear``
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


def upcasts_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether some products of a model on ``device`` in ``dtype`` run through float32 (``linear``)."""
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
# there too (``decode_attention_dtype``): SDPA's one-query path in bfloat16 takes 1.4-2.2x as long as a float32 copy
# of the session's keys and values and SDPA on it (100-1,000 cached positions), while with 2+ query rows the
# half-precision kernel is 0-20 % faster than the copy.
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
# eager at 48 / 64 rows): ``frozen_max_rows``.
FROZEN_HALF_MAX_ROWS = 8


def _linear_upcast(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` of half-precision x [n, in] and weight_t [in, out] in float32: by the weight's float32 copy where
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


def decode_attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a decode row's attention computes in where it is not the model's (``sdpa_attention``): float32 for
    half precision on a CPU without native support (``_UPCAST_DTYPES``), else None."""
    return torch.float32 if device.type == "cpu" and dtype in _UPCAST_DTYPES else None


def frozen_max_rows(device: torch.device, dtype: torch.dtype) -> int:
    """The most rows of a step that the frozen stack runs (``fast_llama``, --compile frozen): every step in float32
    and off the CPU; in half precision on a CPU, the steps below those whose products go through float32
    (``linear``), where the eager layers beat the stack's half-precision GEMMs: FROZEN_HALF_MAX_ROWS without native
    support, NATIVE_BF16_UPCAST_ROWS - 1 with AVX-512-BF16 alone."""
    if device.type != "cpu":
        return _NEVER
    if dtype in _UPCAST_DTYPES:
        return FROZEN_HALF_MAX_ROWS
    return _NATIVE_UPCAST_ROWS.get(dtype, _NEVER + 1) - 1
