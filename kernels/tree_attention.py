"""Tree attention over a paged KV cache: the verify step's attention, many requests in one launch.

The op. Request r owns the packed query rows ``cu_q[r]:cu_q[r + 1]`` (n_r rows) and the key
positions ``[0, kv_len[r])``; its rows are its *last* n_r positions (their keys and values are
already in the cache: the runner writes them before attention). Position p of request r lives in
slot ``block_tables[r, p // block_size] * block_size + p % block_size`` of the cache, which the
kernel reads through the table (no gather copy). Row i of r sits at position
``pos_i = kv_len[r] - n_r + i`` and sees column c iff

    c <= pos_i  and  (c < tree_start[r]  or  bit (c - tree_start[r]) of mask[cu_q[r] + i])

Columns before ``tree_start`` are the prefix every row sees; from ``tree_start`` on, the row's
ancestor bitmask decides (bit j of word w of a mask row = tree column ``32 * w + j``, little-endian
int32 words, ``pack_tree_mask``). The ``c <= pos_i`` term makes one encoding cover both step kinds:

* a tree (verify step, or a drafter's tree step): ``tree_start`` = first tree position; tree
  positions already in the cache may come before the new rows (``tree_start <= kv_len - n_r``);
  nodes are in topological order (a node's ancestors come before it, as ``TokenTree`` guarantees),
  so the causal term never hides an ancestor, and bits past a row's own position are ignored;
* a causal chunk (prefill, a chain, one decode token): ``tree_start = kv_len``: no tree columns,
  no mask row is read, and a prefill chunk of 512 rows needs no bitmask at all (``mask=None`` when
  no request of the launch is a tree).

A row always sees itself, so no row is empty in practice; a row that sees nothing gets zeros.

The launcher checks everything it can without reading device memory (ranks, shapes, dtypes,
devices, unit strides of the metadata); the values are the caller's contract, which the reference
checks: each request's rows are the last of its ``kv_len`` positions, ``tree_start <= kv_len - n_r``
or ``= kv_len``, its table covers ``kv_len``, and ``max_num_new`` is at least every ``n_r``.

Grid and tiling. One program per (query tile, KV head, request). GQA/MQA: the ``group = num_heads //
num_kv_heads`` query heads that share a KV head are packed with the rows into the M dimension of one
tile (M index = row * group + head in group), so each K/V tile is loaded once per group, and a
decode step (one row) gives the MMA ``group`` rows instead of one. BLOCK_M is 16..128 (group x the
longest request's rows, rounded up), BLOCK_N 64 (32 above head_dim 128), head_dim padded to a power
of two >= 16 (masked), up to 256. The key loop has two phases: tiles entirely below
``min(tree_start, first row's position + 1)`` are seen by every row of the tile and run without any
mask; the rest up to the tile's last row's position run with the causal and ancestor masks (a causal
prefill tile stops at its own diagonal). Keys and values past ``kv_len`` are never loaded (the loads
are masked), so unused slots of the cache may hold anything, NaN included. Softmax is online, base
2, with fp32 statistics and an fp32 accumulator; P is cast to the input dtype for the PV product (as
in flash attention). Programs of a query tile past a short request's rows exit at once (the grid is
sized by the longest request: ``max_num_new``).

Split-KV (flash-decoding, ``kv_splits=K``). A small batch at a long prefix runs only B x num_kv_heads x
tiles programs, fewer than a large GPU has SMs (on an H100 at batch 1 and 4k keys: 8 programs on 132 SMs,
23-48x the KV-read bound). With K > 1 the grid's last axis is B x K: program k of a tile walks the k-th of K
equal runs of the tile's key tiles (a run may be empty) and writes its unnormalised state (accumulator,
running max, sum; fp32) to a workspace [K, T, heads, BLOCK_D + 2]; a second kernel combines the K states of
each (row, head) with the usual rescaling (a state that saw no key has max -inf and weighs 0). The split count
is an argument, not a compile-time constant (one variant serves every K; the combining kernel has one per
power of two); ``kv_splits(programs, longest, SMs)`` picks it: enough shares to give each SM a program, each
of at least ``SPLIT_MIN_KEYS`` keys, rounded down to a power of two, 1 when the launch already fills the GPU.

Dtypes: fp16 / bf16 / fp32 in, same dtype out. fp32 dots use IEEE precision (no TF32). Under the
Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) bf16 dots are not implemented (the
interpreter multiplies the raw bits, triton-lang/triton#11584), so there bf16 operands are widened
to fp32 before the dots; on a GPU the dots take the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
WORD_BITS = 32


# ---------------------------------------------------------------------------------------- kernel
# Integer arguments that change from step to step are not specialized: Triton compiles a variant per
# value class (== 1, divisible by 16, other) of every integer argument and per 16-byte alignment of
# every pointer, so a head stride that follows the step's row count, a table width that follows the
# longest request, or a mask width would each compile new variants in the middle of serving (seen on
# an H200: steps of 0.6 s while a draft model's varying batches compiled one variant after another).
# The launcher's callers keep the metadata pointers 16-byte aligned for the same reason; the strides
# that the K/V and output addressing depends on stay specialized (their divisibility lets the loads
# vectorize) and are fixed for a cache.
@triton.jit(do_not_specialize=["stride_qh", "stride_table", "stride_mask", "block_size", "splits", "stride_ps"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    cu_q_ptr, kv_len_ptr, tree_start_ptr, block_tables_ptr, mask_ptr, partial_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh,
    stride_table, stride_mask,
    block_size, qk_scale, splits, stride_ps, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_M // GROUP  # query rows per tile
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    req, split = tl.program_id(2) // splits, tl.program_id(2) % splits
    q_start = tl.load(cu_q_ptr + req)
    num_rows = tl.load(cu_q_ptr + req + 1) - q_start
    first_row = tile * ROWS
    if first_row >= num_rows:
        return
    kv_len = tl.load(kv_len_ptr + req)
    tree_start = tl.load(tree_start_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row = first_row + offs_m // GROUP  # [BLOCK_M] query row within the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < ROWS * GROUP) & (row < num_rows)
    d_ok = offs_d < HEAD_DIM
    pos = kv_len - num_rows + row  # [BLOCK_M] the row's own position
    packed_row = q_start + row

    q = tl.load(q_ptr + packed_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # this program's key tiles: all of them, or (split-KV) its share of the tiles up to the tile's last row
    last_row = tl.minimum(first_row + ROWS, num_rows) - 1
    end = kv_len - num_rows + last_row + 1
    per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, end)

    # phase 1: columns every row of the tile sees (prefix, and a causal tile's columns below its first row)
    shared_end = tl.minimum(tree_start, kv_len - num_rows + first_row + 1)
    full_end = (shared_end // BLOCK_N) * BLOCK_N
    for start in range(lo, tl.minimum(full_end, hi), BLOCK_N):
        cols = start + offs_n
        slots = (tl.load(table + cols // block_size).to(tl.int64) * block_size + cols % block_size)
        k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=d_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    # phase 2: the rest up to the tile's last row, under the causal and ancestor masks
    for start in range(tl.maximum(full_end, lo), hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < kv_len
        slots = (tl.load(table + cols // block_size, mask=col_ok, other=0).to(tl.int64) * block_size
                 + cols % block_size)
        k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=d_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        visible = cols[None, :] <= pos[:, None]
        if HAS_MASK:
            in_tree = (cols >= tree_start) & col_ok
            bit = tl.maximum(cols - tree_start, 0)  # [BLOCK_N] tree column (0 in the prefix, unused there)
            words = tl.load(mask_ptr + packed_row[:, None] * stride_mask + (bit // 32)[None, :],
                            mask=row_ok[:, None] & in_tree[None, :], other=0)
            ancestor = ((words >> (bit % 32)[None, :]) & 1) != 0
            visible = visible & ((cols < tree_start)[None, :] | ancestor)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:  # the share's unnormalised state, [splits, T, heads, BLOCK_D + 2] fp32: acc, then m and l
        row_base = (partial_ptr + split.to(tl.int64) * stride_ps
                    + (packed_row.to(tl.int64) * num_heads + head) * (BLOCK_D + 2))
        tl.store(row_base[:, None] + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(row_base + BLOCK_D, m_i, mask=row_ok)
        tl.store(row_base + BLOCK_D + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + packed_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["splits", "stride_ps"])
def _combine_splits_kernel(partial_ptr, out_ptr, splits, stride_ps, stride_ot, stride_oh, num_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits' states (M = max_s m_s; a
    split that saw no key has m = -inf and weighs 0)."""
    t, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < splits
    row = partial_ptr + offs_s.to(tl.int64) * stride_ps + (t.to(tl.int64) * num_heads + h) * (BLOCK_D + 2)
    m = tl.load(row + BLOCK_D, mask=s_ok, other=float("-inf"))
    sums = tl.load(row + BLOCK_D + 1, mask=s_ok, other=0.0)
    acc = tl.load(row[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.where(top == float("-inf"), 0.0, top)))
    total = tl.sum(w * sums, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


INTERPRETED = not isinstance(_tree_attention_kernel, triton.runtime.JITFunction)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# -------------------------------------------------------------------------------------- launcher
def tree_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], any strides
    k_cache: torch.Tensor,  # [num_kv_heads, num_slots, head_dim], one layer's keys (any strides)
    v_cache: torch.Tensor,  # [num_kv_heads, num_slots, head_dim]
    cu_q: torch.Tensor,  # [B + 1] int32: request r owns rows cu_q[r]:cu_q[r + 1]
    kv_len: torch.Tensor,  # [B] int32: request r attends to positions [0, kv_len[r]), its rows are the last
    tree_start: torch.Tensor,  # [B] int32: first tree column (kv_len[r] for a causal request)
    block_tables: torch.Tensor,  # [B, max_blocks] int32: request r's blocks, in order (padded)
    block_size: int,
    mask: torch.Tensor | None = None,  # [T, num_words] int32 ancestor bits (pack_tree_mask); None = all causal
    *,
    max_num_new: int | None = None,  # >= the rows of every request (sizes the grid); None = from cu_q: a host sync
    scale: float | None = None,  # softmax scale; None = head_dim ** -0.5
    kv_splits: int = 1,  # programs sharing each tile's keys (split-KV, ``kv_splits``), their states combined after
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Tree attention of B requests' packed rows over their paged keys/values (see the module docstring
    for the mask rule). Returns [T, num_heads, head_dim], contiguous, in q's dtype."""
    _check(q, k_cache, v_cache, cu_q, kv_len, tree_start, block_tables, block_size, mask)
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    num_requests = kv_len.shape[0]
    out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0 or num_requests == 0:
        return out
    if max_num_new is None:
        max_num_new = int((cu_q[1:] - cu_q[:-1]).max())  # host sync: pass max_num_new to avoid it
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    auto_m, auto_n, _, auto_stages = launch_config(group, max_num_new, head_dim)
    block_m = max(block_m or auto_m, triton.next_power_of_2(group))  # a tile holds at least one row's heads
    block_n = block_n or auto_n
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    num_stages = num_stages or auto_stages
    rows_per_tile = block_m // group
    if kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    grid = (triton.cdiv(max_num_new, rows_per_tile), num_kv_heads, num_requests * kv_splits)
    dot_dtype = tl.float32 if INTERPRETED and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    partial = None
    if kv_splits > 1:  # [splits, T, heads, BLOCK_D + 2] fp32: each share's accumulator, max and sum
        partial = torch.empty((kv_splits, total, num_heads, block_d + 2), dtype=torch.float32, device=q.device)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out,
        cu_q, kv_len, tree_start, block_tables, mask if mask is not None else cu_q,
        partial if partial is not None else out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), mask.stride(0) if mask is not None else 0,
        block_size, (head_dim**-0.5 if scale is None else scale) * math.log2(math.e),
        kv_splits, partial.stride(0) if partial is not None else 0, num_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, SPLIT=partial is not None, DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if partial is not None:
        _combine_splits_kernel[(total, num_heads)](
            partial, out, kv_splits, partial.stride(0), out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(kv_splits)),
        )
    return out


SPLIT_MIN_KEYS = 512  # keys per share at least: below that a share's fixed cost outweighs the parallelism
MAX_SPLITS = 16


def kv_splits(num_programs: int, longest: int, num_sms: int | None) -> int:
    """How many programs should share each tile's keys (flash-decoding): 1 when the launch already has a program
    per SM (``num_sms``; None = not a GPU) or the longest request is short; else enough shares to fill the SMs,
    each of at least SPLIT_MIN_KEYS keys, rounded down to a power of two (CUDA graphs bucket on it)."""
    if num_sms is None or num_programs >= num_sms or longest < 2 * SPLIT_MIN_KEYS:
        return 1
    want = min(-(-num_sms // num_programs), longest // SPLIT_MIN_KEYS, MAX_SPLITS)
    return 1 << (want.bit_length() - 1)


def num_programs(num_heads: int, num_kv_heads: int, max_num_new: int, head_dim: int, num_requests: int) -> int:
    """Programs of an unsplit launch: query tiles x KV heads x requests."""
    group = num_heads // num_kv_heads
    block_m = max(launch_config(group, max_num_new, head_dim)[0], triton.next_power_of_2(group))
    return triton.cdiv(max_num_new, block_m // group) * num_kv_heads * num_requests


def launch_config(group: int, max_num_new: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the launcher picks for ``max_num_new`` rows of ``group``
    heads: BLOCK_M = rows x heads of the group, 16 (decode) .. 128 (prefill chunks)."""
    block_m = min(128 if group * max_num_new >= 512 else 64, max(16, triton.next_power_of_2(group * max_num_new)))
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, (64 if head_dim <= 128 else 32), (8 if block_m >= 128 else 4), 3


def compile_variants(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                     max_rows: int = 1024) -> int:
    """Launch every kernel variant a model of this shape can need (each tile size the launcher picks for 1 ..
    ``max_rows`` rows, with and without a tree mask) once on dummy rows, so that Triton compiles them at
    load rather than during the first steps that need them. Returns how many variants were launched."""
    group = num_heads // num_kv_heads
    rows_for: dict[int, int] = {}  # BLOCK_M -> the fewest rows that select it
    for n in _powers_of_two(max_rows):
        rows_for.setdefault(launch_config(group, n, head_dim)[0], n)
    block_size = 16
    blocks = -(-max(rows_for.values()) // block_size)
    cache = torch.zeros((num_kv_heads, blocks * block_size, head_dim), dtype=dtype, device=device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    launched = 0
    for rows in rows_for.values():
        q = torch.zeros((num_heads, rows, head_dim), dtype=dtype, device=device).transpose(0, 1)  # as the runner's
        meta = torch.zeros(12, dtype=torch.int32, device=device)  # cu_q, kv_len, tree_start: 16-byte aligned
        meta[1], meta[4] = rows, rows
        cu_q, kv_len, tree_start = meta[0:2], meta[4:5], meta[8:9]
        tree = torch.full((rows, 1), -1, dtype=torch.int32, device=device)  # every row sees all earlier nodes
        for splits in (1, 2):  # unsplit, and split-KV (one variant for every share count)
            tree_attention(q, cache, cache, cu_q, kv_len, kv_len, tables, block_size, None, max_num_new=rows,
                           kv_splits=splits)
            tree_attention(q, cache, cache, cu_q, kv_len, tree_start, tables, block_size, tree, max_num_new=rows,
                           kv_splits=splits)
            launched += 2
    for splits in _powers_of_two(MAX_SPLITS)[2:]:  # the combining kernel's other share counts (2 ran above)
        tree_attention(q, cache, cache, cu_q, kv_len, kv_len, tables, block_size, None, max_num_new=rows,
                       kv_splits=splits)
        launched += 1
    return launched


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(1, limit).bit_length())]


def _check(q, k_cache, v_cache, cu_q, kv_len, tree_start, block_tables, block_size, mask) -> None:
    """ValueError for anything the kernel cannot read as documented (shapes, dtypes, devices, strides)."""
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError(f"q [T, heads, head_dim] and k_cache/v_cache [kv_heads, slots, head_dim] must be 3-D, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[0]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {k_cache.shape[2]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside [1, {MAX_HEAD_DIM}]")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cu_q": cu_q, "kv_len": kv_len,
               "tree_start": tree_start, "block_tables": block_tables}
    if mask is not None:
        tensors["mask"] = mask
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    for name in ("cu_q", "kv_len", "tree_start", "block_tables", "mask"):
        if name in tensors and tensors[name].dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensors[name].dtype}")
    num_requests = kv_len.shape[0] if kv_len.ndim == 1 else -1
    if kv_len.ndim != 1 or tree_start.shape != kv_len.shape or cu_q.shape != (num_requests + 1,):
        raise ValueError(f"kv_len and tree_start must be [B] and cu_q [B + 1], got {tuple(kv_len.shape)}, "
                         f"{tuple(tree_start.shape)}, {tuple(cu_q.shape)}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_requests:
        raise ValueError(f"block_tables must be [B={num_requests}, max_blocks], got {tuple(block_tables.shape)}")
    if any(t.stride(-1) != 1 for t in (cu_q, kv_len, tree_start, block_tables) if t.numel() > 1):
        raise ValueError("cu_q, kv_len, tree_start and block_tables need a unit stride along their last dim")
    if mask is not None and (mask.ndim != 2 or mask.shape[0] != q.shape[0] or (mask.shape[1] > 1 and mask.stride(1) != 1)):
        raise ValueError(f"mask must be [T={q.shape[0]}, num_words] with unit stride along words, "
                         f"got {tuple(mask.shape)} strides {mask.stride()}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


# ------------------------------------------------------------------------------------- mask bits
def pack_tree_mask(ancestors: torch.Tensor) -> torch.Tensor:
    """[n, num_tree] bool -> [n, ceil(num_tree / 32)] int32: bit j of word w = column 32 * w + j."""
    n, num_tree = ancestors.shape
    num_words = -(-num_tree // WORD_BITS)
    bits = torch.zeros((n, num_words * WORD_BITS), dtype=torch.int64, device=ancestors.device)
    bits[:, :num_tree] = ancestors.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=ancestors.device) << torch.arange(
        WORD_BITS, device=ancestors.device)
    words = (bits.view(n, num_words, WORD_BITS) * weights).sum(-1)  # [n, num_words], in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def unpack_tree_mask(words: torch.Tensor, num_tree: int) -> torch.Tensor:
    """[n, num_words] int32 -> [n, num_tree] bool (inverse of ``pack_tree_mask``)."""
    shifts = torch.arange(WORD_BITS, device=words.device)
    bits = (words.to(torch.int64)[:, :, None] >> shifts) & 1  # [n, num_words, 32]
    return bits.reshape(words.shape[0], -1)[:, :num_tree].bool()


# ------------------------------------------------------------------------------------- reference
def tree_attention_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, num_slots, head_dim]
    v_cache: torch.Tensor,  # [num_kv_heads, num_slots, head_dim]
    cu_q: torch.Tensor,  # [B + 1] int
    kv_len: torch.Tensor,  # [B] int
    tree_start: torch.Tensor,  # [B] int
    block_tables: torch.Tensor,  # [B, max_blocks] int
    block_size: int,
    mask: torch.Tensor | None = None,  # [T, num_words] int32
    scale: float | None = None,
) -> torch.Tensor:
    """The same op in plain PyTorch, one request at a time: gather the request's keys/values through its
    table, build its [n, kv_len] visibility, softmax. Computes in q's dtype widened to at least fp32 (pass
    float64 tensors for a float64 reference); returns [T, num_heads, head_dim] in q's dtype."""
    total, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[0]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros((total, num_heads, head_dim), dtype=compute, device=q.device)
    for r in range(kv_len.shape[0]):
        first, last = int(cu_q[r]), int(cu_q[r + 1])
        n, end, tree = last - first, int(kv_len[r]), int(tree_start[r])
        if n == 0:
            continue
        if n > end or tree > end or (tree < end and tree > end - n):
            raise ValueError(f"request {r}: {n} rows, kv_len {end}, tree_start {tree}: the rows must be the last "
                             f"kv_len positions and tree columns (tree_start <= kv_len - rows, or = kv_len)")
        cols = torch.arange(end, device=q.device)
        slots = block_tables[r].long()[cols // block_size] * block_size + cols % block_size  # [end]
        keys = k_cache[:, slots].to(compute).repeat_interleave(group, 0)  # [num_heads, end, head_dim]
        values = v_cache[:, slots].to(compute).repeat_interleave(group, 0)
        positions = end - n + torch.arange(n, device=q.device)
        visible = cols[None, :] <= positions[:, None]  # [n, end]
        if mask is not None and tree < end:
            ancestors = torch.zeros((n, end), dtype=torch.bool, device=q.device)
            ancestors[:, tree:] = unpack_tree_mask(mask[first:last], end - tree)
            visible &= (cols < tree)[None, :] | ancestors
        scores = torch.einsum("nhd,hkd->hnk", q[first:last].to(compute), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
        out[first:last] = torch.einsum("hnk,hkd->nhd", probs, values)
    return out.to(q.dtype)


__all__ = ["compile_variants", "kv_splits", "launch_config", "num_programs", "pack_tree_mask", "tree_attention", "tree_attention_reference", "unpack_tree_mask"]
