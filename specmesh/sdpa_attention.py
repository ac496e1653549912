"""The fast runner's PyTorch attention (``attention="sdpa"``, any device and dtype): ``SdpaAttention``, one
forward's attention over its sessions' caches, with its CPU variants: many short sessions in one padded call
(``padded_attention.py``), a decode row over a large stitched table read in place run by run
(``in_place_sessions``), a half-precision decode row in float32 (``cpu_platform.decode_attention_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specmesh import cpu_platform
from specmesh.kv_pool import KVPool, write_slots
from specmesh.model_runner import TreeMask
from specmesh.padded_attention import PAD_LIMIT, PAD_MAX_NEW, padded_layout, padded_sdpa

# SDPA backends on CUDA: not cuDNN's, which builds (and caches) an execution graph per new shape, hundreds of
# milliseconds each, and every step here brings new lengths
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SdpaRunner(Protocol):
    """What the attention reads of its runner (``fast_llama.FastLlamaRunner``, which imports this module)."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    scale: float  # head_dim ** -0.5
    q_size: int  # num_heads * head_dim: a row of the attention's output
    kv_size: int  # num_kv_heads * head_dim


class SdpaAttention:
    """PyTorch SDPA. Sessions in one paged pool write their new keys/values with one scatter per layer; of those,
    the ones with short contexts and few new rows attend in one padded SDPA call (``padded_attention``), the
    rest in one call per session over their own span under a dense [n, end] mask (a view of the pool when
    their blocks are contiguous, else a gathered copy; a decode row over a large stitched table on the CPU: one
    call per run of its blocks, on views, merged by log-sum-exp, ``in_place_sessions``). Index tensors are built
    once per forward, on the host, and copied once."""

    def __init__(self, runner: SdpaRunner, caches, num_new: Sequence[int], attends) -> None:
        # spans: [cache, packed rows, start, end, mask, causal, runs of a stitched decode row read in place or None]
        self.runner, self.spans, self.padded = runner, [], None
        # a decode row in half precision on a CPU without native support: its attention in float32
        # (SDPA's one-query path in bfloat16 takes 2x as long as its copy in float32 there)
        self.compute_dtype = cpu_platform.decode_attention_dtype(runner.device, runner.dtype)
        # one scatter for the new rows of several sessions of one pool; a single session writes its own slice
        pool = caches[0].pool if len(caches) > 1 else None
        if pool is not None and not all(c.pool is pool for c in caches):
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
                elif cache.base is None and runner.device.type == "cpu":
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
# (``SdpaAttention``). The gather copies the session's context every layer of every step; reading in place adds
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

