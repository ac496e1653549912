"""KV block bookkeeping: which blocks of a paged pool are free, and block tables for sessions (no torch).

The tensors live in ``specmesh.kv_pool``; the verifier also accounts a generic runner's
per-session caches in blocks through this allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specmesh.contract import CapacityError

DEFAULT_BLOCK_SIZE = 16


class BlockAllocator:
    """Which of ``num_blocks`` blocks are free; hands out block tables, contiguous where it can."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = np.ones(num_blocks, dtype=bool)

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _runs(self) -> list[tuple[int, int]]:
        """Maximal runs of free blocks as (start, length), in block order."""
        padded = np.concatenate([[False], self._free, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))  # starts at even indices, ends at odd ones
        return [(int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2], strict=True)]

    def allocate(self, num_tokens: int) -> list[int]:
        """A block table for ``num_tokens`` slots: one contiguous run when a free run is long enough (the
        shortest such run, keeping long runs for long requests), else the longest runs first.
        Raises CapacityError when fewer blocks are free than needed."""
        need = self.blocks_for(num_tokens)
        if need > self.num_free:
            raise CapacityError(
                f"the KV pool has {self.num_free} free blocks of {self.block_size} tokens, "
                f"the request needs {need} ({num_tokens} tokens)"
            )
        runs = self._runs()
        fitting = [run for run in runs if run[1] >= need]
        if fitting:
            start, _ = min(fitting, key=lambda run: run[1])
            table = list(range(start, start + need))
        else:
            table = []
            for start, length in sorted(runs, key=lambda run: -run[1]):
                take = min(length, need - len(table))
                table.extend(range(start, start + take))
                if len(table) == need:
                    break
        self._free[table] = False
        return table

    def free(self, table: Sequence[int]) -> None:
        if len(table) and self._free[list(table)].any():
            raise RuntimeError("freeing a KV block that is already free")
        self._free[list(table)] = True


__all__ = ["DEFAULT_BLOCK_SIZE", "BlockAllocator"]
