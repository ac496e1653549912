"""Attention of many sessions with short contexts as one SDPA call over a padded batch.

A verify step of many sessions feeds each a few new rows (1 for plain decoding). Calling SDPA once
per session and layer costs ~15 us of launch overhead each on the CPU, far more than the arithmetic
of a short context; gathering every session's keys from the paged pool into
[sessions, kv_heads, max_len, head_dim] and running one SDPA under a key mask costs a copy of the
keys instead. The copy grows with the context while the per-call overhead does not, so the fast
runner batches only the sessions whose keys are small (``PAD_LIMIT``) and keeps one SDPA per session
for the rest. Measured on this project's 2-core VM (1-layer, 128-wide Llama, 64 decoding sessions of
mixed lengths, glibc tuned as ``specmesh/host_runtime.py`` does), a whole verify step: padded
12 % faster at 32-48 positions, 6 % slower at 80-120, 12 % slower at 150-225 and 1.7x slower at
600-900; so the limit is the break-even, ~80 positions of 128 key elements.

The keys are gathered a whole block at a time (one index per block of ``block_size`` positions, not one per
position: 6-7x faster on the CPU), so a session's row of keys runs to the end of its last block, and a session
with fewer blocks than the longest is padded with copies of its first block. Every key past a session's end
is masked; the ones whose slot may never have been written (the rest of its last block, and of the copies of
its first block when that is its last) are zeroed in the gathered copy, because the pool is allocated with
``torch.empty`` and a masked key holding NaN would still poison the weighted sum. Padded query rows repeat the
session's last real row; their outputs are dropped.

``padded_layout`` is the host side (numpy, once per forward); ``padded_sdpa`` runs one layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specmesh.kv_pool import gather_blocks

PAD_LIMIT = 10240  # key elements (positions x kv_heads x head_dim) per session and layer up to which to pad
PAD_MAX_NEW = 16  # sessions feeding more rows (prompt chunks, large trees) keep their own call


@dataclass(frozen=True)
class PaddedLayout:
    """G sessions' attention as one SDPA call over padded [G, heads, max_new, key_len] scores."""

    num_sessions: int  # G
    max_new: int
    key_len: int  # gathered keys per session: the most blocks of any session x block_size
    key_blocks: np.ndarray  # [G * key_len / block_size] int64: pool block of each gathered block, session by session
    unwritten: np.ndarray | None  # int64 positions in the gathered [G * key_len] keys to zero; None: none
    query_rows: np.ndarray | None  # [G * max_new] int64 packed row of each padded query; None: q's rows as they are
    out_rows: np.ndarray | None  # [sum num_new] int64 index into the G * max_new outputs; None: all of them
    mask: np.ndarray | None  # [G, 1, max_new, key_len] bool, True = attend; None: every key of every row


def padded_layout(
    tables: Sequence[Sequence[int]],  # [G] each [>= ceil(end_g / block_size)]: the pool blocks of session g
    block_size: int,
    starts: np.ndarray,  # [G] int64: cached positions before the step
    num_new: np.ndarray,  # [G] int64: new rows of session g
    row_starts: np.ndarray,  # [G] int64: first packed row of session g
    attends: Sequence[object],  # [G]: None (causal), a TreeMask, or a dense [num_new, end] bool tensor
    total_rows: int,  # T: packed rows of the whole forward (other sessions' rows included)
) -> PaddedLayout:
    """The host-side indices and mask of ``padded_sdpa`` for G sessions."""
    ends = starts + num_new
    num, max_new = len(ends), int(num_new.max())
    used = -(-ends // block_size)  # [G] blocks holding positions [0, end)
    most = int(used.max())
    key_len = most * block_size
    # block b of session g: its own while it has one, then its first again
    picks = np.where(np.arange(most)[None] < used[:, None], np.arange(most)[None], 0)  # [G, most]
    key_blocks = np.concatenate([np.asarray(table[: used[g]], np.int64)[picks[g]] for g, table in enumerate(tables)])
    columns = np.arange(key_len)
    # the position each gathered key holds in its session; past its end it may never have been written
    source = np.where(columns[None] < (used * block_size)[:, None], columns[None], columns[None] % block_size)
    unwritten = np.flatnonzero(source >= ends[:, None])
    rows = np.arange(max_new)
    query_rows = out_rows = None
    if num * max_new != total_rows or (row_starts != np.arange(num) * max_new).any():  # not q's rows as they are
        query_rows = (row_starts[:, None] + np.minimum(rows[None], num_new[:, None] - 1)).reshape(-1)
    if not (num_new == max_new).all():
        out_rows = (np.arange(num)[:, None] * max_new + rows[None])[rows[None] < num_new[:, None]]
    mask = None
    if max_new > 1 or (ends != key_len).any() or any(a is not None for a in attends):
        # causal by default: row i of session g sees keys 0..start_g + i (never past its end, for padded rows)
        last_key = np.minimum(starts[:, None] + rows[None], ends[:, None] - 1)  # [G, max_new]
        mask = columns[None, None] <= last_key[:, :, None]  # [G, max_new, key_len]
        for g, attend in enumerate(attends):
            if attend is None:
                continue
            n, end = int(num_new[g]), int(ends[g])
            if isinstance(attend, torch.Tensor):  # dense [n, end]
                mask[g, :n, :end] = attend.cpu().numpy()
            else:  # TreeMask: the whole prefix, then the ancestors
                mask[g, :n, : attend.prefix_len] = True
                mask[g, :n, attend.prefix_len : end] = attend.ancestors.cpu().numpy()
        mask = mask[:, None]
    return PaddedLayout(num, max_new, key_len, key_blocks, unwritten if len(unwritten) else None, query_rows,
                        out_rows, mask)


def padded_sdpa(
    q: torch.Tensor,  # [heads, T, head_dim]: the packed queries of the step
    keys: torch.Tensor,  # [kv_heads, slots, head_dim]: one layer of the pool (the new rows already written)
    values: torch.Tensor,  # [kv_heads, slots, head_dim]
    layout: PaddedLayout,
    key_blocks: torch.Tensor,  # layout.key_blocks on q's device
    unwritten: torch.Tensor | None,  # layout.unwritten on q's device
    query_rows: torch.Tensor | None,  # layout.query_rows on q's device
    out_rows: torch.Tensor | None,  # layout.out_rows on q's device
    mask: torch.Tensor | None,  # layout.mask on q's device
    scale: float,
    compute_dtype: torch.dtype | None = None,  # the attention's arithmetic in this dtype (None: q's)
) -> torch.Tensor:
    """[sum num_new, heads * head_dim]: the attention outputs of the G sessions' real rows, in packed order, in
    q's dtype."""
    heads, head_dim = q.shape[0], q.shape[2]
    g, max_new, key_len = layout.num_sessions, layout.max_new, layout.key_len
    kv_heads = keys.shape[0]
    block_size = key_len * g // len(key_blocks)

    def gather(pool: torch.Tensor) -> torch.Tensor:  # [G, kv_heads, key_len, head_dim]
        rows = gather_blocks(pool, key_blocks, block_size)  # [kv_heads, G * key_len, head_dim]
        if unwritten is not None:
            rows.index_fill_(1, unwritten, 0)
        return rows.view(kv_heads, g, key_len, head_dim).transpose(0, 1)

    k, v, dtype = gather(keys), gather(values), q.dtype
    if query_rows is not None:
        q = q.index_select(1, query_rows)
    q = q.reshape(heads, g, max_new, head_dim).transpose(0, 1)  # [G, heads, max_new, head_dim]
    if compute_dtype is not None:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    out = out.transpose(1, 2).reshape(g * max_new, heads * head_dim)
    if compute_dtype is not None:
        out = out.to(dtype)
    return out if out_rows is None else out.index_select(0, out_rows)


__all__ = ["PAD_LIMIT", "PAD_MAX_NEW", "PaddedLayout", "padded_layout", "padded_sdpa"]
