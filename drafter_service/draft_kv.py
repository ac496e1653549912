"""The draft model's KV: every session's cache in one paged pool of the draft runner, within a fixed budget.

A draft model keeps keys/values per session (the committed context it has read, so that the next proposal feeds
only what is new). They live in one ``KVPool`` per draft runner (``draft_kv``: shared by every proposer on that
runner, e.g. ``draft_model`` and ``draft_model_tree`` inside ``fused``), sized in GiB like the verifier's
(``--draft-kv-cache-gb``; by default 1 GiB, or what 64 sessions at the draft's full context need if less), so the
draft's memory is allocated once, when the process starts, and never grows
behind the budget's back. On a CPU an untouched page of the pool costs nothing; on CUDA the pool is reserved when
the first draft-model proposer is built, before a verifier in the same process sizes its own pool from what is
left.

A draft cache is a cache: losing it costs a re-read of the context, never a different output. So the pool never
refuses a proposal for memory while it can make room: a draft step first takes the blocks its sessions' rows
write (``hold``: the context plus the step's drafted rows, a bound the proposer gives), and when the pool is short
it empties the least recently used caches that no draft step is using (their sessions re-read their context when
they next draft); before that, idle caches give back the blocks past their last position (``PagedKVCache.trim``:
the rows of rejected drafts, which a running session otherwise keeps for its next step instead of taking new
blocks every step). A session whose step cannot get its blocks even then drafts nothing this time (its cache is
emptied too); the verifier then verifies the pending token alone, as for any empty tree.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.blocks import DEFAULT_BLOCK_SIZE, FULL_CONTEXT_SESSIONS, blocks_in, default_gib
from specmesh.contract import CapacityError
from specmesh.models import positive_float

if TYPE_CHECKING:  # the argument parsers import this module: torch only where a pool is made
    from specmesh.kv_pool import PagedKVCache

log = logging.getLogger(__name__)

DEFAULT_DRAFT_KV_GB = 1.0  # per draft runner; a 30-layer, 576-wide bf16 draft (23 KiB/token) holds ~46,000 tokens


@dataclass(eq=False)
class DraftCache:
    """One session's draft KV: the runner's cache and the tokens it holds, in order."""

    cache: PagedKVCache  # in the draft pool
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values the cache holds, in order


class DraftKV:
    """The paged pool of one draft runner and its sessions' caches, least recently used first."""

    def __init__(self, runner, kv_cache_gb: float = DEFAULT_DRAFT_KV_GB, block_size: int = DEFAULT_BLOCK_SIZE):
        self.runner, self.kv_cache_gb = runner, kv_cache_gb
        self.pool = runner.new_pool(blocks_in(kv_cache_gb, runner.kv_bytes_per_token, block_size), block_size)
        self._lock = threading.Lock()
        self._caches: OrderedDict[int, DraftCache] = OrderedDict()  # id -> cache, least recently used first
        self._held: dict[int, int] = {}  # id -> draft steps using the cache now
        self._released: set[int] = set()  # held caches whose session ended: freed when the last step lets go
        self.evictions = 0  # caches emptied to make room
        self.starved = 0  # sessions that drafted nothing for want of blocks

    @property
    def capacity_tokens(self) -> int:
        """Positions the pool holds."""
        return self.pool.allocator.num_blocks * self.pool.allocator.block_size

    @property
    def blocks_used(self) -> int:
        return self.pool.allocator.num_used

    def new(self) -> DraftCache:
        """An empty cache for a session (no blocks until a step holds it)."""
        dc = DraftCache(self.pool.open(0))
        with self._lock:
            self._caches[id(dc)] = dc
        return dc

    def release(self, dc: DraftCache | None) -> None:
        """The session ended: its blocks go back to the pool (once no draft step uses them: a session may end on
        one thread while its next tree is drafted on another)."""
        if dc is None:
            return
        with self._lock:
            self._caches.pop(id(dc), None)
            if id(dc) in self._held:
                self._released.add(id(dc))
            else:
                self._empty(dc)

    @contextmanager
    def hold(self, caches: Sequence[DraftCache], lengths: Sequence[int]) -> Iterator[list[bool]]:
        """Use ``caches`` for one draft step, each with room for ``lengths[i]`` positions (its context and every
        row the step feeds): yields, per cache, whether it got them. A cache that did not is empty and must not
        be fed this step. Room comes from free blocks, then from emptying the least recently used caches that no
        step holds (their blocks past their last position first: the rejected rows of earlier steps)."""
        ok = [True] * len(caches)
        with self._lock:
            for dc in caches:  # all held before any makes room: none of them is evicted for another
                if id(dc) not in self._released:  # (a released one stays out of the LRU order)
                    self._caches.pop(id(dc), None)
                    self._caches[id(dc)] = dc  # most recently used
                self._held[id(dc)] = self._held.get(id(dc), 0) + 1
            for i, (dc, length) in enumerate(zip(caches, lengths, strict=True)):
                if not self._room(dc, length):
                    self._empty(dc)
                    self.starved += 1
                    ok[i] = False
        try:
            yield ok
        finally:
            with self._lock:
                for dc in caches:
                    count = self._held.pop(id(dc), 0) - 1
                    if count > 0:
                        self._held[id(dc)] = count
                    elif id(dc) in self._released:
                        self._released.discard(id(dc))
                        self._empty(dc)

    def _room(self, dc: DraftCache, length: int) -> bool:
        """Blocks for ``length`` positions in ``dc``, evicting idle caches as needed (under the lock)."""
        allocator = self.pool.allocator
        missing = allocator.blocks_for(length) - len(dc.cache.table)
        if missing > allocator.num_free:
            idle = [c for key, c in self._caches.items() if key not in self._held]  # least recently used first
            for other in idle:  # first the blocks past each idle cache's last position (rejected draft rows)
                other.cache.trim()
            for other in idle:
                if missing <= allocator.num_free:
                    break
                if other.cache.table:
                    self._empty(other)
                    self.evictions += 1
        try:
            dc.cache.ensure(length)
        except CapacityError:
            return False
        return True

    def _empty(self, dc: DraftCache) -> None:
        dc.cache.free()
        dc.cached = []


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def default_draft_kv_gb(runner) -> float:
    """DEFAULT_DRAFT_KV_GB, capped by ``blocks.default_gib`` (FULL_CONTEXT_SESSIONS sessions at the draft's full
    context)."""
    return default_gib(DEFAULT_DRAFT_KV_GB, runner.info.max_positions, runner.kv_bytes_per_token)


def draft_kv(runner, kv_cache_gb: float | None = None) -> DraftKV:
    """The draft runner's ``DraftKV``, made on first use (``kv_cache_gb``, or ``default_draft_kv_gb``). A host that
    sizes it (``--draft-kv-cache-gb``) calls this before building its proposers; asking for another size once it
    exists is an error."""
    with _POOLS_LOCK:
        kv = _POOLS.get(runner)
        if kv is None:
            kv = _POOLS[runner] = DraftKV(runner, default_draft_kv_gb(runner) if kv_cache_gb is None else kv_cache_gb)
            log.info("draft model KV pool: %d tokens in %g GiB", kv.capacity_tokens, kv.kv_cache_gb)
        elif kv_cache_gb is not None and kv_cache_gb != kv.kv_cache_gb:
            raise ValueError(f"the draft model's KV pool already has {kv.kv_cache_gb} GiB; asked for {kv_cache_gb}")
        return kv


def add_draft_kv_argument(p) -> None:
    """``--draft-kv-cache-gb``: the draft model's paged KV pool (embedded commands and the drafter server)."""
    p.add_argument("--draft-kv-cache-gb", type=positive_float, default=None, metavar="GB",
                   help="memory of the draft model's paged KV pool, shared by its sessions; when it is short, idle "
                        "sessions' draft caches are emptied and re-read later, never changing an output "
                        f"(default: {DEFAULT_DRAFT_KV_GB:g}, or less when {FULL_CONTEXT_SESSIONS} sessions at the draft's "
                        "full context need less)")


__all__ = ["DEFAULT_DRAFT_KV_GB", "DraftCache", "DraftKV", "add_draft_kv_argument", "default_draft_kv_gb", "draft_kv"]
