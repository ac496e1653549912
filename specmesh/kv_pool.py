"""A paged KV pool shared by every session of one model: the one KV cache of every runner.

Storage: one keys and one values tensor per model, [num_layers, num_kv_heads,
num_blocks * block_size, head_dim]; a *slot* is ``block * block_size + offset``.
A session owns a block table (its blocks, in order); position p of the session
lives in slot ``table[p // block_size] * block_size + p % block_size``.

A session's table grows as its positions do (``ensure``: the blocks a step's rows write, taken before the
forward) and shrinks back to the blocks holding its positions (``trim``: a rejected tree branch's blocks go
back after compaction); ``free`` gives back every block (release, or preemption: the session's positions are
computed again when it resumes). A table is contiguous where the allocator can keep it so (then the PyTorch
attention path reads the session's keys as a view, without a gather); a table stitched from several runs (a
prefix-cache hit: the cached blocks, then the session's own) works everywhere: its decode rows read it run by run
in place on the CPU (``slot_runs``), other rows through a gather. Compaction after a tree step moves only the
accepted tree rows; the prefix is never copied.

``specmesh.blocks.BlockAllocator`` is the bookkeeping (no torch); ``KVPool`` adds the tensors and
``PagedKVCache`` is one session's view of them (ensure / trim / free / write / kv / keep / truncate / length).

Every session of every runner is a ``PagedKVCache``. A verifier's or a drafter's sessions share the pool it sized
(``runner.new_pool``: a ``KVPool``, fixed, so a CUDA graph captured over it stays valid); a session outside any
budget (``runner.new_cache``: the one-request paths, probes, tests) gets a pool of its own that grows with it
(``GrowingKVPool``: reallocated as it grows, so never captured in a graph; one session, so always one run of blocks
read as a view). A model whose attention caches are not keys and values of one shape in every layer (a sliding
window, linear attention, layers of different shapes) has no paged pool, and the runners refuse it
(``model_runner.paged_shape``, a ValueError naming the caches found) rather than keep a second cache kind behind
the same interface: nothing in the project needs one (its models are Llama-family, GPT-2 and Qwen2 without
sliding windows), and the transformers ``DynamicCache`` that served them before could not speculate: a sliding
layer keeps only its last window of keys, which the cache's tree mask and compaction (absolute positions) do not
fit. Measured on the code before the change, a 2-layer Mistral with a 16-token window through the verifier: plain
decoding matched the model's greedy output, ``prompt_lookup_tree`` gave another output on one prompt of three and
failed with a shape error on the other two.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specmesh.blocks import DEFAULT_BLOCK_SIZE, BlockAllocator
from specmesh.contract import CapacityError
from specmesh.row_ops import pack


class KVPool:
    """The pool's tensors: keys/values [num_layers, num_kv_heads, (num_blocks + 1) * block_size, head_dim]. The
    last block is scratch, in no table: a CUDA graph's padding rows write there (``scratch_slot``). Its size is
    fixed (``fixed``): the tensors are never reallocated, so a CUDA graph may be captured over them."""

    fixed = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.keys, self.values = self._tensors(num_layers, num_kv_heads, head_dim, num_blocks, dtype, device)
        self.scratch_slot = num_blocks * block_size  # the first slot of the scratch block
        self.device = self.keys.device

    def _tensors(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for ``num_blocks`` blocks and the scratch block."""
        shape = (num_layers, num_kv_heads, (num_blocks + 1) * self.block_size, head_dim)
        # empty, not zeros: a slot is always written before it is read (attention reads positions [0, length)
        # only), and on the CPU untouched pages of an empty tensor take no memory, so a generous budget costs
        # only what the sessions use
        # normal tensors even when built under inference mode: sessions write and compact them in or out of it
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def open(self, num_tokens: int, cached: Sequence[int] = ()) -> PagedKVCache:
        """A session cache with blocks for its first ``num_tokens`` positions (it takes more as it grows,
        ``PagedKVCache.ensure``): first ``cached``, blocks the prefix cache found (``BlockAllocator.lookup``),
        shared and their positions counted in its length, then new ones. CapacityError (nothing taken) when the
        pool has too few free."""
        self.allocator.share(cached)  # before taking the rest: found blocks are not evicted for it
        cache = PagedKVCache(self, list(cached))
        cache.length = len(cached) * self.block_size
        try:
            cache.ensure(num_tokens)
        except CapacityError:
            cache.free()
            raise
        return cache

    def take(self, table: list[int], num_blocks: int) -> None:
        """Append ``num_blocks`` free blocks to ``table`` (``BlockAllocator.grow``); CapacityError (nothing taken)
        when too few are free."""
        self.allocator.grow(table, num_blocks)


GROW_CHUNK = 256  # positions a growing pool starts with (at most the model's context)


class GrowingKVPool(KVPool):
    """The pool of one session outside any budget (``ModelRunner.new_cache``): it starts at GROW_CHUNK positions
    and at least doubles whenever its session needs more blocks than it has free, up to ``max_positions`` (more only
    when asked for more). Growing reallocates the tensors, keeping every block's slots: such a pool is never
    captured in a CUDA graph (``fixed`` is False). Its one session's table is always blocks 0, 1, ...: one run,
    read as a view."""

    fixed = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_positions: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.max_blocks = max(1, -(-max_positions // block_size))
        super().__init__(num_layers, num_kv_heads, head_dim, min(-(-GROW_CHUNK // block_size), self.max_blocks),
                         block_size, dtype, device)

    def take(self, table: list[int], num_blocks: int) -> None:
        allocator = self.allocator
        short = num_blocks - allocator.num_free
        if short > 0:
            need = allocator.num_blocks + short
            self._grow(min(max(need, 2 * allocator.num_blocks), max(self.max_blocks, need)))
        allocator.grow(table, num_blocks)

    def _grow(self, num_blocks: int) -> None:
        """Reallocate the tensors for ``num_blocks`` blocks, the slots of the blocks so far copied over."""
        layers, heads, _, head_dim = self.keys.shape
        keys, values = self._tensors(layers, heads, head_dim, num_blocks, self.keys.dtype, self.device)
        with torch.inference_mode(False), torch.no_grad():
            keys[:, :, : self.scratch_slot] = self.keys[:, :, : self.scratch_slot]
            values[:, :, : self.scratch_slot] = self.values[:, :, : self.scratch_slot]
        self.allocator.add_blocks(num_blocks - self.allocator.num_blocks)
        self.keys, self.values = keys, values
        self.scratch_slot = num_blocks * self.block_size


def gather_blocks(layer: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[kv_heads, len(blocks) * block_size, head_dim]: the slots of ``blocks`` of one layer of the pool
    ([kv_heads, slots, head_dim]), in order, as a copy. One index per block, not per slot: several times faster
    on the CPU (6-7x for 64 sessions of 160 positions)."""
    heads, _, head_dim = layer.shape
    return layer.view(heads, -1, block_size * head_dim).index_select(1, blocks).view(heads, -1, head_dim)


def write_slots(caches: Sequence[PagedKVCache], starts: Sequence[int], num_new: Sequence[int]) -> np.ndarray:
    """[sum(num_new)] int64: the pool slot of each new row, session by session (positions starts[i] + j, j <
    num_new[i], already in the sessions' tables). A one-row session's slot is read off its table with integer
    arithmetic (plain decoding: most sessions of a step; an array slice each costs ~3x more)."""
    size = caches[0].pool.block_size
    return pack([cache.table[start // size] * size + start % size if n == 1 else cache.host_slots[start : start + n]
                 for cache, start, n in zip(caches, starts, num_new, strict=True)])


class PagedKVCache:
    """One session's positions in a KVPool: a block table that grows with the positions (``ensure``)."""

    def __init__(self, pool: KVPool, table: list[int]) -> None:
        self.pool, self.table = pool, table
        self.length = 0
        self._resized(_is_run(table))

    def _resized(self, contiguous: bool) -> None:
        """The table changed: its capacity, whether it is one run of blocks (then ``base``, its first slot), and
        the derived arrays, rebuilt when next used."""
        self.capacity = len(self.table) * self.pool.block_size
        self.base = self.table[0] * self.pool.block_size if contiguous and self.table else None
        self._host_slots = self._slots = self._blocks = self._runs = None

    @property
    def host_slots(self) -> np.ndarray:
        """[capacity] int64: the slot of each position, on the host (index building)."""
        if self._host_slots is None:
            size = self.pool.block_size
            self._host_slots = (np.asarray(self.table, np.int64)[:, None] * size + np.arange(size)).reshape(-1)
        return self._host_slots

    @property
    def slots(self) -> torch.Tensor:
        """[capacity] long: the slot of each position, on the pool's device."""
        if self._slots is None:
            self._slots = torch.from_numpy(self.host_slots).to(self.pool.device, non_blocking=True)
        return self._slots

    @property
    def blocks(self) -> torch.Tensor:
        """[blocks] long: the table on the pool's device."""
        if self._blocks is None:
            self._blocks = torch.as_tensor(self.table, dtype=torch.long).to(self.pool.device, non_blocking=True)
        return self._blocks

    def slot_runs(self, end: int) -> list[tuple[int, int]]:
        """[(first slot, last slot + 1)] of the runs of consecutive blocks that hold positions [0, end), in
        position order: one for a contiguous table; a table stitched from prefix-cache blocks and its own, two or
        a few. Attention reads each run in place (``sdpa_attention.SdpaAttention``) instead of gathering the table."""
        if self._runs is None:  # [(first block, blocks)] per run, rebuilt when the table changes
            table = np.asarray(self.table, np.int64)
            cuts = np.flatnonzero(np.diff(table) != 1) + 1
            self._runs = [(int(run[0]), len(run)) for run in np.split(table, cuts)] if len(table) else []
        size, runs, position = self.pool.block_size, [], 0
        for block, count in self._runs:
            if position >= end:
                break
            take = min(count * size, end - position)
            runs.append((block * size, block * size + take))
            position += take
        return runs

    # ------------------------------------------------------------ cache interface
    def ensure(self, length: int) -> None:
        """Hold positions [0, length): take the blocks missing from the pool. CapacityError (nothing taken) when
        it has too few free."""
        if length <= self.capacity:  # every step but one in a block's worth: nothing to take
            return
        old = len(self.table)
        was_run = self.base is not None or not old
        self.pool.take(self.table, self.pool.allocator.blocks_for(length) - old)
        added = self.table[old:]
        self._resized(was_run and _is_run(added) and (not old or added[0] == self.table[old - 1] + 1))

    def trim(self) -> int:
        """Give back the blocks past the one holding the last position; returns how many."""
        keep = self.pool.allocator.blocks_for(self.length)
        extra = self.table[keep:]
        if extra:
            self.pool.allocator.free(extra)
            del self.table[keep:]
            self._resized(self.base is not None or _is_run(self.table))  # a run stays one
        return len(extra)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [num_kv_heads, n, head_dim] for positions [start, start + n)."""
        end = start + keys.shape[1]
        if self.base is not None:
            self.pool.keys[layer, :, self.base + start : self.base + end] = keys
            self.pool.values[layer, :, self.base + start : self.base + end] = values
        else:
            slots = self.slots[start:end]
            self.pool.keys[layer].index_copy_(1, slots, keys)
            self.pool.values[layer].index_copy_(1, slots, values)

    def kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_kv_heads, end, head_dim] keys and values of positions [0, end): a view when contiguous."""
        if self.base is not None:
            return (self.pool.keys[layer, :, self.base : self.base + end],
                    self.pool.values[layer, :, self.base : self.base + end])
        blocks = self.blocks[: -(-end // self.pool.block_size)]
        return (gather_blocks(self.pool.keys[layer], blocks, self.pool.block_size)[:, :end],
                gather_blocks(self.pool.values[layer], blocks, self.pool.block_size)[:, :end])

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv(layer, self.length)

    def keep(self, prefix_len: int, keep_offsets: Sequence[int]) -> None:
        """Keep positions [0, prefix_len) plus ``prefix_len + o`` for o in keep_offsets (ascending): only the
        kept tree rows move (all layers at once), the prefix stays where it is. ``compact`` for one session."""
        compact([self], [prefix_len], [keep_offsets])

    def free(self) -> int:
        """Return every block to the pool (idempotent; the cache may grow again from empty); returns how many."""
        freed = len(self.table)
        if freed:
            self.pool.allocator.free(self.table)
            self.table = []
            self._resized(False)
        self.length = 0
        return freed


def _is_run(table: list[int]) -> bool:
    """Whether ``table`` is one run of consecutive blocks, ascending."""
    return bool(table) and table[-1] - table[0] == len(table) - 1 and (
        len(table) < 3 or table == list(range(table[0], table[-1] + 1)))


def compact(caches: Sequence[PagedKVCache], prefix_lens: Sequence[int],
            keep_offsets: Sequence[Sequence[int]]) -> None:
    """``keep`` for many sessions at once: session r keeps positions [0, prefix_lens[r]) plus
    ``prefix_lens[r] + o`` for o in keep_offsets[r] (ascending, distinct). The rows that move, of every session
    of a pool, move in one gather and one scatter over all layers (src/dst: the concatenated slots); a session
    whose kept offsets are already 0..k-1 moves nothing. No autograd state is touched (the pool's tensors never
    require grad), so it runs in or out of inference mode."""
    moves: dict[int, tuple[KVPool, list[np.ndarray], list[np.ndarray]]] = {}
    for cache, prefix_len, offsets in zip(caches, prefix_lens, keep_offsets, strict=True):
        num_kept = len(offsets)
        # ascending distinct offsets >= 0 are the identity exactly when the last one is num_kept - 1
        if num_kept and offsets[-1] != num_kept - 1:
            _, src, dst = moves.setdefault(id(cache.pool), (cache.pool, [], []))
            src.append(cache.host_slots[prefix_len + np.asarray(offsets, np.int64)])
            dst.append(cache.host_slots[prefix_len : prefix_len + num_kept])
        cache.length = prefix_len + num_kept
    for pool, src, dst in moves.values():
        index = torch.from_numpy(np.concatenate(src + dst)).to(pool.device, non_blocking=True)  # one copy per pool
        src_slots, dst_slots = index.split(len(index) // 2)
        for store in (pool.keys, pool.values):  # [layers, kv_heads, slots, head_dim]
            store.index_copy_(2, dst_slots, store.index_select(2, src_slots))


__all__ = ["DEFAULT_BLOCK_SIZE", "GROW_CHUNK", "BlockAllocator", "GrowingKVPool", "KVPool", "PagedKVCache",
           "compact", "gather_blocks"]
