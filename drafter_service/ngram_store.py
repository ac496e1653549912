"""N-gram stores: which token sequences followed a context, counted; shared by drafters.

A store maps a context (the last n tokens, ``min_n <= n <= max_n``) to the
continuations seen after it (the next ``span`` tokens) with counts, and keeps the
``top_n`` most frequent per context. ``lookup`` answers with the continuations of
the longest stored suffix of a context, most frequent first: what retrieval
drafting (REST) and fleet learning build trees from.

Two backends with the same semantics, exactly (the tests check them against each
other on random update/query sequences):

- ``MemoryNGramStore``: a dict in this process, the embedded default.
- ``RedisNGramStore``: one sorted set per context (member = continuation packed as
  big-endian uint32, score = count). Every update is one Lua script call on one key
  (increment, trim to ``top_n``, refresh the TTL), sent in pipelines, so a batch
  costs one round trip and each key's update is atomic. Keys are
  ``specmesh:<namespace>:ng:{<context hex>}``: the hash tag is the context, so keys
  spread over a Redis Cluster and no call touches two slots.

The namespace is the tokenizer fingerprint (``tokenizer_fingerprint``): models with
different vocabularies never read each other's n-grams.

Order and trimming follow Redis's sorted-set rules in both backends: ranks are by
(count, packed member) ascending; trimming drops the lowest ranks after each
increment; lookups read from the highest rank down.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("specmesh.ngram_store")

Continuation = tuple[int, ...]


@dataclass(frozen=True)
class StoreConfig:
    min_n: int = 2  # shortest context looked up
    max_n: int = 4  # longest context stored
    span: int = 8  # tokens per continuation
    top_n: int = 16  # continuations kept per context
    ttl_s: int = 0  # Redis: seconds a context lives after its last update (0 = forever)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n or self.span < 1 or self.top_n < 1 or self.ttl_s < 0:
            raise ValueError("need 1 <= min_n <= max_n, span >= 1, top_n >= 1, ttl_s >= 0")


class NGramStore(Protocol):
    config: StoreConfig
    namespace: str

    def add(self, tokens: Sequence[int]) -> None:
        """Count every (context, continuation) of a token sequence."""
        ...

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        """Up to k (continuation, count) of the longest stored suffix of ``context``, most frequent first."""
        ...


def tokenizer_fingerprint(vocab: dict[str, int]) -> str:
    """16 hex digits identifying a vocabulary (token string -> id); the store namespace."""
    digest = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def ngram_entries(tokens: Sequence[int], config: StoreConfig) -> Iterator[tuple[Continuation, Continuation]]:
    """(context, continuation) for every position followed by a whole span, contexts min_n..max_n long,
    in a fixed order (both backends apply them in this order)."""
    tokens = [int(t) for t in tokens]
    for end in range(config.min_n, len(tokens) - config.span + 1):
        cont = tuple(tokens[end : end + config.span])
        for n in range(config.min_n, min(config.max_n, end) + 1):
            yield tuple(tokens[end - n : end]), cont


def pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(tokens)}I", *tokens)


def unpack(member: bytes) -> Continuation:
    return struct.unpack(f">{len(member) // 4}I", member)


def _check(tokens: Sequence[int]) -> None:
    if any(not 0 <= int(t) < 2**32 for t in tokens):
        raise ValueError("token ids must fit in uint32")


class MemoryNGramStore:
    def __init__(self, config: StoreConfig | None = None, namespace: str = "default") -> None:
        self.config = config or StoreConfig()
        self.namespace = namespace
        self._table: dict[Continuation, dict[bytes, int]] = {}

    def add(self, tokens: Sequence[int]) -> None:
        _check(tokens)
        for ctx, cont in ngram_entries(tokens, self.config):
            counts = self._table.setdefault(ctx, {})
            member = pack(cont)
            counts[member] = counts.get(member, 0) + 1
            if len(counts) > self.config.top_n:
                ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
                for member, _ in ranked[: len(counts) - self.config.top_n]:
                    del counts[member]

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        for n in range(min(self.config.max_n, len(context)), self.config.min_n - 1, -1):
            counts = self._table.get(tuple(int(t) for t in context[len(context) - n :]))
            if counts:
                ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:k]
                return [(unpack(m), c) for m, c in ranked]
        return []

    def __len__(self) -> int:
        return len(self._table)


# increment one continuation of one context, trim to the top_n best ranks, refresh the TTL
_UPDATE = """
redis.call('ZINCRBY', KEYS[1], 1, ARGV[1])
local keep = tonumber(ARGV[2])
local size = redis.call('ZCARD', KEYS[1])
if size > keep then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, size - keep - 1) end
local ttl = tonumber(ARGV[3])
if ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
return size
"""


class RedisNGramStore:
    """The store in Redis (redis-py); ``client``: a ``redis.Redis`` with ``decode_responses=False``."""

    def __init__(self, client, config: StoreConfig | None = None, namespace: str = "default",
                 batch: int = 512) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("the namespace may not contain braces (they mark Redis Cluster hash tags)")
        self.client = client
        self.config = config or StoreConfig()
        self.namespace = namespace
        self.batch = batch  # script calls per pipeline round trip
        self._update = client.register_script(_UPDATE)

    @classmethod
    def from_url(cls, url: str, config: StoreConfig | None = None, namespace: str = "default",
                 timeout_s: float = 0.5) -> RedisNGramStore:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, config, namespace)

    def key(self, context: Sequence[int]) -> str:
        return f"specmesh:{self.namespace}:ng:{{{pack(context).hex()}}}"

    def add(self, tokens: Sequence[int]) -> None:
        _check(tokens)
        args = (self.config.top_n, self.config.ttl_s)
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for ctx, cont in ngram_entries(tokens, self.config):
            self._update(keys=[self.key(ctx)], args=[pack(cont), *args], client=pipe)
            pending += 1
            if pending == self.batch:
                pipe.execute()
                pending = 0
        if pending:
            pipe.execute()

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        lengths = range(min(self.config.max_n, len(context)), self.config.min_n - 1, -1)
        pipe = self.client.pipeline(transaction=False)
        for n in lengths:  # every suffix in one round trip; the longest that exists wins
            pipe.zrevrange(self.key(context[len(context) - n :]), 0, k - 1, withscores=True)
        for rows in pipe.execute():
            if rows:
                return [(unpack(m), int(c)) for m, c in rows]
        return []


class FallbackNGramStore:
    """Redis first, this process's memory when Redis fails: a request never fails for the store.

    Every update also goes to the memory store, so after a Redis outage drafting goes on with
    what this process has seen. After a failure Redis is left alone for ``retry_after_s``."""

    def __init__(self, primary: NGramStore, fallback: MemoryNGramStore, retry_after_s: float = 5.0) -> None:
        self.primary, self.fallback = primary, fallback
        self.config, self.namespace = primary.config, primary.namespace
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self.failures = 0

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("n-gram store unavailable (%s: %s); using this process's memory for %.0f s",
                    type(exc).__name__, exc, self.retry_after_s)

    def add(self, tokens: Sequence[int]) -> None:
        self.fallback.add(tokens)
        if self._usable():
            try:
                self.primary.add(tokens)
            except Exception as exc:  # any backend failure: carry on in memory
                self._failed(exc)

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        if self._usable():
            try:
                return self.primary.lookup(context, k)
            except Exception as exc:
                self._failed(exc)
        return self.fallback.lookup(context, k)
