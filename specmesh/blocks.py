"""KV block bookkeeping: which blocks of a paged pool are free, and block tables for sessions (no torch).

Tables grow and shrink a block at a time (a session takes the blocks its rows write, step by step, and gives
back those of a rejected tree branch), so placement keeps tables contiguous where it can: a table grows into
the block right after its last one when that is free, and a new table starts in the middle of the largest
free run when a table before that run may still grow into it. A contiguous table lets attention on the CPU
read the session's keys as a view; a table stitched from several runs works everywhere (decode rows read its runs
in place on the CPU, other rows through a gather).

**Prefix cache.** A full block of a session's committed tokens may be ``register``ed under a chained key (its
tokens and the key of the block before it, so a key stands for the whole prefix up to the block's end); a new
session's ``lookup`` walks its prompt's full blocks through the keys and ``share``s the blocks it finds: they are
read-only (a session writes only past its committed tokens, never into a full block) and reference-counted. A
cached block that no table holds any more stays cached, *evictable*: it counts as free and is reclaimed least
recently used first when the free blocks run out. A key is only a shortcut: each entry keeps its block's tokens
and the registration serial of the block before it, and a lookup compares both, so a hash collision (or a parent
evicted and its block reused) ends the match instead of serving another prefix's KV.

The tensors live in ``specmesh.kv_pool``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specmesh.contract import CapacityError

DEFAULT_BLOCK_SIZE = 16
FULL_CONTEXT_SESSIONS = 64  # a default-sized pool never holds more than this many sessions at the full context


def blocks_in(gib: float, bytes_per_token: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens of ``bytes_per_token`` each that fit in ``gib`` GiB (at least one);
    ValueError unless ``gib`` > 0."""
    if not gib > 0:
        raise ValueError(f"a KV cache budget must be > 0 GiB, got {gib}")
    return max(1, int(gib * 2**30 // (bytes_per_token * block_size)))


def default_gib(budget_gib: float, max_positions: int, bytes_per_token: int) -> float:
    """``budget_gib``, but never more than FULL_CONTEXT_SESSIONS sessions at the model's full context (counted up to
    65,536 positions) need: a tiny model does not reserve gigabytes whose pages its sessions touch bit by bit."""
    full = FULL_CONTEXT_SESSIONS * min(max_positions, 1 << 16) * bytes_per_token / 2**30
    return min(budget_gib, full)


@dataclass(slots=True)
class _Entry:
    """A cached block: its key, its tokens, its registration serial and its parent's (0: the first block)."""

    key: int
    block: int
    tokens: tuple[int, ...]
    serial: int
    parent: int


class BlockAllocator:
    """Which of ``num_blocks`` blocks are free; hands out and grows block tables, contiguous where it can, and
    keeps the prefix cache (module doc). ``num_free`` counts the evictable cached blocks too."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = np.ones(num_blocks, dtype=bool)  # held by no table and caching nothing
        self._refs = np.zeros(num_blocks, dtype=np.int32)  # tables holding each block
        self.num_free = num_blocks  # free + evictable
        self._entries: dict[int, _Entry] = {}  # key -> cached block
        self._cached: dict[int, _Entry] = {}  # block -> its entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none: least recently used first
        self._serial = 0
        self.queries = self.hits = 0  # prompt tokens looked up, and found (counters)

    @property
    def num_used(self) -> int:
        """Blocks some table holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, tokens: Sequence[int], max_blocks: int, count: bool = True) -> list[int]:
        """The cached blocks holding ``tokens``' first full blocks, in order (at most ``max_blocks``): the longest
        cached prefix. Counts the query (tokens of ``max_blocks`` blocks) and the hit unless ``count`` is False (a
        look before admitting); ``share`` takes them."""
        size, found, key, parent = self.block_size, [], 0, 0
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            key = hash((key, block_tokens))
            entry = self._entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != block_tokens:
                break  # not cached (or a collision: never another prefix's KV)
            found.append(entry.block)
            parent = entry.serial
        if count:
            self.queries += max_blocks * size
            self.hits += len(found) * size
        return found

    def num_unheld(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` no table holds (evictable: sharing them takes them out of the free count)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def share(self, blocks: Sequence[int]) -> None:
        """Hold cached ``blocks`` (from ``lookup``) in one more table."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
                self.num_free -= 1
            self._refs[block] += 1

    def register(self, table: Sequence[int], tokens: Sequence[int], first: int, end: int) -> None:
        """Cache blocks ``first`` to ``end - 1`` of ``table``, full of ``tokens`` (the table's tokens from position
        0), each under the key of its prefix. A block is cached only after its parent (a prefix is found from its
        start), and not when its prefix is cached already in another block (computed twice: that block stays)."""
        size = self.block_size
        for i in range(first, end):
            block = table[i]
            if block in self._cached:
                continue
            parent = self._cached.get(table[i - 1]) if i else None
            if i and parent is None:
                return
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            key = hash((parent.key if parent else 0, block_tokens))
            if key in self._entries:
                return  # the same prefix (or a colliding one) lives in another block: its children go there
            self._serial += 1
            entry = _Entry(key, block, block_tokens, self._serial, parent.serial if parent else 0)
            self._entries[key] = self._cached[block] = entry

    def _evict(self, count: int) -> None:
        """Make ``count`` evictable blocks free, least recently used first."""
        for _ in range(count):
            block, _ = self._evictable.popitem(last=False)
            entry = self._cached.pop(block)
            del self._entries[entry.key]
            self._free[block] = True

    def add_blocks(self, count: int) -> None:
        """``count`` more free blocks, numbered after the last (a pool that grows: ``kv_pool.GrowingKVPool``)."""
        self._free = np.concatenate([self._free, np.ones(count, dtype=bool)])
        self._refs = np.concatenate([self._refs, np.zeros(count, dtype=np.int32)])
        self.num_blocks += count
        self.num_free += count

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
        short = num_blocks - (self.num_free - len(self._evictable))
        if short > 0:
            self._evict(short)
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
        self._refs[new] = 1
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
        """Drop a table's hold on its blocks: a block no table holds is free, or evictable if cached."""
        if not len(table):
            return
        blocks = list(table)
        refs = self._refs[blocks]
        if (refs <= 0).any():
            raise RuntimeError("freeing a KV block that is already free")
        self._refs[blocks] = refs - 1
        for block in reversed(blocks):  # a table's tail is evicted first: its prefix stays findable longest
            if self._refs[block] == 0:
                self.num_free += 1
                if block in self._cached:
                    self._evictable[block] = None
                else:
                    self._free[block] = True


__all__ = ["DEFAULT_BLOCK_SIZE", "BlockAllocator"]
