"""Attention of many sessions with short contexts as one SDPA call over a padded batch.

A verify step of many sessions feeds each a few new rows (1 for plain decoding). Calling SDPA once
per session and layer costs ~15 us of launch overhead each on the CPU, far more than the arithmetic
of a short context; gathering every session's keys from the paged pool into
[sessions, kv_heads, max_len, head_dim] and running one SDPA under a key mask costs a copy of the
keys instead. The copy grows with the context while the per-call overhead does not, so the fast
runner batches only the sessions whose keys are small (``PAD_LIMIT``, measured on the CPU: below it
one padded call was 2-7x cheaper per session, above ~32k elements per session and layer the gather
cost more than it saved) and keeps one SDPA per session for the rest.

Padding never reads an unwritten slot: a session's key row is padded by repeating its last
position (the pool is allocated with ``torch.empty``, and a masked key with NaN values would still
poison the weighted sum), and padded query rows repeat the session's last real row; their outputs
are dropped.

``padded_layout`` is the host side (numpy, once per forward); ``padded_sdpa`` runs one layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

PAD_LIMIT = 24576  # key elements (positions x kv_heads x head_dim) per session and layer up to which to pad
PAD_MAX_NEW = 16  # sessions feeding more rows (prompt chunks, large trees) keep their own call


@dataclass(frozen=True)
class PaddedLayout:
    """G sessions' attention as one SDPA call over padded [G, heads, max_new, max_end] scores."""

    num_sessions: int  # G
    max_new: int
    max_end: int
    key_slots: np.ndarray  # [G * max_end] int64: pool slot of session g's key j (past its end: its last one)
    query_rows: np.ndarray | None  # [G * max_new] int64 packed row of each padded query; None: q's rows as they are
    out_rows: np.ndarray | None  # [sum num_new] int64 index into the G * max_new outputs; None: all of them
    mask: np.ndarray | None  # [G, 1, max_new, max_end] bool, True = attend; None: every key of every row


def padded_layout(
    slot_rows: Sequence[np.ndarray],  # [G] each [>= end_g] int64: pool slot of each position of session g
    starts: np.ndarray,  # [G] int64: cached positions before the step
    num_new: np.ndarray,  # [G] int64: new rows of session g
    row_starts: np.ndarray,  # [G] int64: first packed row of session g
    attends: Sequence[object],  # [G]: None (causal), a TreeMask, or a dense [num_new, end] bool tensor
    total_rows: int,  # T: packed rows of the whole forward (other sessions' rows included)
) -> PaddedLayout:
    """The host-side indices and mask of ``padded_sdpa`` for G sessions."""
    ends = starts + num_new
    num, max_new, max_end = len(ends), int(num_new.max()), int(ends.max())
    columns = np.arange(max_end)
    key_slots = np.stack([slots[np.minimum(columns, end - 1)] for slots, end in zip(slot_rows, ends, strict=True)])
    rows = np.arange(max_new)
    query_rows = out_rows = None
    if num * max_new != total_rows or (row_starts != np.arange(num) * max_new).any():  # not q's rows as they are
        query_rows = (row_starts[:, None] + np.minimum(rows[None], num_new[:, None] - 1)).reshape(-1)
    if not (num_new == max_new).all():
        out_rows = (np.arange(num)[:, None] * max_new + rows[None])[rows[None] < num_new[:, None]]
    mask = None
    if max_new > 1 or (ends != max_end).any() or any(a is not None for a in attends):
        # causal by default: row i of session g sees keys 0..start_g + i (never past its end, for padded rows)
        last_key = np.minimum(starts[:, None] + rows[None], ends[:, None] - 1)  # [G, max_new]
        mask = columns[None, None] <= last_key[:, :, None]  # [G, max_new, max_end]
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
    return PaddedLayout(num, max_new, max_end, key_slots.reshape(-1), query_rows, out_rows, mask)


def padded_sdpa(
    q: torch.Tensor,  # [heads, T, head_dim]: the packed queries of the step
    keys: torch.Tensor,  # [kv_heads, slots, head_dim]: one layer of the pool (the new rows already written)
    values: torch.Tensor,  # [kv_heads, slots, head_dim]
    layout: PaddedLayout,
    key_slots: torch.Tensor,  # layout.key_slots on q's device
    query_rows: torch.Tensor | None,  # layout.query_rows on q's device
    out_rows: torch.Tensor | None,  # layout.out_rows on q's device
    mask: torch.Tensor | None,  # layout.mask on q's device
    scale: float,
) -> torch.Tensor:
    """[sum num_new, heads * head_dim]: the attention outputs of the G sessions' real rows, in packed order."""
    heads, head_dim = q.shape[0], q.shape[2]
    g, max_new, max_end = layout.num_sessions, layout.max_new, layout.max_end
    kv_heads = keys.shape[0]
    k = keys.index_select(1, key_slots).view(kv_heads, g, max_end, head_dim).transpose(0, 1)
    v = values.index_select(1, key_slots).view(kv_heads, g, max_end, head_dim).transpose(0, 1)
    if query_rows is not None:
        q = q.index_select(1, query_rows)
    q = q.reshape(heads, g, max_new, head_dim).transpose(0, 1)  # [G, heads, max_new, head_dim]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    out = out.transpose(1, 2).reshape(g * max_new, heads * head_dim)
    return out if out_rows is None else out.index_select(0, out_rows)


__all__ = ["PAD_LIMIT", "PAD_MAX_NEW", "PaddedLayout", "padded_layout", "padded_sdpa"]
