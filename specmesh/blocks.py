"""KV block bookkeeping: which blocks of a paged pool are free, and block tables for sessions (no torch).

Tables grow and shrink a block at a time (a session takes the blocks its rows write, step by step, and gives
back those of a rejected tree branch), so placement keeps tables contiguous where it can: a table grows into
the block right after its last one when that is free, and a new table starts in the middle of the largest
free run when a table before that run may still grow into it. A contiguous table lets attention on the CPU
read the session's keys as a view; a table stitched from several runs works everywhere, through a gather.

The tensors live in ``specmesh.kv_pool``; the verifier also accounts a generic runner's
per-session caches in blocks through this allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specmesh.contract import CapacityError

DEFAULT_BLOCK_SIZE = 16


class BlockAllocator:
    """Which of ``num_blocks`` blocks are free; hands out and grows block tables, contiguous where it can."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = np.ones(num_blocks, dtype=bool)
        self.num_free = num_blocks

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
        """A new block table for ``num_tokens`` slots (see ``grow``). CapacityError when fewer blocks are free."""
        table: list[int] = []
        self.grow(table, self.blocks_for(num_tokens))
        return table

    def grow(self, table: list[int], num_blocks: int) -> None:
        """Append ``num_blocks`` free blocks to ``table`` (in place): the blocks right after its last one while they
        are free, then runs from the largest free run; a new table starts in the middle of the largest run when a
        used block precedes that run (the table before it keeps room to grow), else at its start. CapacityError
        when fewer blocks are free (the table is left as it was)."""
        if num_blocks > self.num_free:
            raise CapacityError(f"the KV pool has {self.num_free} free blocks of {self.block_size} tokens, "
                                f"{num_blocks} more are needed")
        need, grown = num_blocks, len(table)
        if table and need:  # the blocks right after the table's last one
            after = table[-1] + 1
            stop = after
            while stop < self.num_blocks and stop - after < need and self._free[stop]:
                stop += 1
            table.extend(range(after, stop))
            need -= stop - after
        while need:
            start, length = max(self._runs_excluding(table[grown:]), key=lambda run: run[1])
            if not table and start > 0 and length >= 2 * need:
                start += length // 2
                length -= length // 2
            take = min(length, need)
            table.extend(range(start, start + take))
            need -= take
        new = table[grown:]
        self._free[new] = False
        self.num_free -= len(new)

    def _runs_excluding(self, taken: Sequence[int]) -> list[tuple[int, int]]:
        """Free runs, not counting ``taken`` blocks (chosen by this call, not yet marked)."""
        if not taken:
            return self._runs()
        self._free[list(taken)] = False
        try:
            return self._runs()
        finally:
            self._free[list(taken)] = True

    def free(self, table: Sequence[int]) -> None:
        if not len(table):
            return
        blocks = list(table)
        if self._free[blocks].any():
            raise RuntimeError("freeing a KV block that is already free")
        self._free[blocks] = True
        self.num_free += len(blocks)


__all__ = ["DEFAULT_BLOCK_SIZE", "BlockAllocator"]
