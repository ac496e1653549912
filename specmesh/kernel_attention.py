"""The fast runner's adapter to the tree-attention kernel (``attention="triton"``, ``kernels/tree_attention.py``).

``kernel_metadata`` builds a step's metadata on the host (``KernelMetadata``: row offsets, lengths, tree starts,
block tables, write slots, ancestor bits); ``KernelAttention`` carries it to the device in one copy and runs every
session of the forward in one launch per layer. The runner runs it eagerly (``fast_llama.py``), a CUDA graph
replays it on static buffers (``cuda_graphs.py``): both import it from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import numpy as np
import torch

from specmesh.kv_pool import PagedKVCache

ALIGN_INT32 = 4  # int32 elements per 16 bytes


class KernelRunner(Protocol):
    """What the kernel path reads of its runner (``fast_llama.FastLlamaRunner``, which imports this module)."""

    device: torch.device
    scale: float  # head_dim ** -0.5
    q_size: int  # num_heads * head_dim: a row of the attention's output
    _kernels: ModuleType  # kernels.tree_attention

    def _kv_splits(self, max_num_new: int, num_requests: int, longest: int) -> int:
        """Programs sharing each tile's keys in a launch (kernels.tree_attention.kv_splits; 1 off CUDA)."""
        ...


@dataclass
class KernelMetadata:
    """A step's tree-attention metadata on the host (``kernels.tree_attention``'s arguments), for B sessions and
    T packed rows: where the keys live and which rows see which columns."""

    keys: torch.Tensor  # the storage read: the pool's [layers, kv_heads, slots, head_dim]
    values: torch.Tensor
    block_size: int
    cu_q: np.ndarray  # [B + 1] row offsets
    kv_len: np.ndarray  # [B] positions after the step
    tree_start: np.ndarray  # [B] first tree column (kv_len: causal)
    tables: np.ndarray  # [B, blocks] block tables, each cut to its blocks in use (zeros after)
    slots: np.ndarray  # [T] the slot each new row writes
    words: np.ndarray  # [T, W] ancestor bits of the tree rows (zeros elsewhere; W = 0 without a tree)
    has_tree: bool


def kernel_metadata(runner: KernelRunner, caches: Sequence[PagedKVCache], num_new: Sequence[int],
                    attends) -> KernelMetadata:
    """The step's metadata for sessions ``caches`` (of one pool) appending ``num_new`` rows under ``attends``
    (TreeMask or None = causal); ValueError for a node that attends to a later node."""
    pool = caches[0].pool
    keys, values, block_size = pool.keys, pool.values, pool.block_size
    tables = [np.asarray(c.table, np.int64) for c in caches]
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


class KernelAttention:
    """Every session in one tree-attention launch per layer: the new keys/values of all sessions written with
    one scatter, then read back with the prefix through the block tables. The step's metadata (row offsets,
    lengths, tables, slots, ancestor bits) is built on the host and crosses to the device in one copy."""

    @staticmethod
    def applies(caches: Sequence[PagedKVCache], attends) -> bool:
        """Whether one launch per layer can run the forward: every session in one pool, no dense mask (it has no
        tree structure to pass)."""
        if any(isinstance(a, torch.Tensor) for a in attends):
            return False
        pool = caches[0].pool
        return all(c.pool is pool for c in caches)

    def __init__(self, runner: KernelRunner, meta: KernelMetadata, num_new: Sequence[int]) -> None:
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
    def of(cls, runner: KernelRunner, keys, values, block_size: int, cu_q, kv_len, tree_start, tables, slots, mask,
           max_num_new: int, splits: int = 1) -> KernelAttention:
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


__all__ = ["KernelAttention", "KernelMetadata", "kernel_metadata"]
