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

import dataclasses
import gzip
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specmesh.atomic_io import atomic_write

log = logging.getLogger("specmesh.ngram_store")

Continuation = tuple[int, ...]
SNAPSHOT_FORMAT = "specmesh-ngram-store/1"
MEMORY_MAX_CONTEXTS = 1 << 20  # contexts a drafter's own memory store keeps (~0.3-0.5 GB at the defaults)


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

    def add(self, tokens: Sequence[int], start: int = 0, partial: bool = False) -> None:
        """Count the (context, continuation) entries of a token sequence (see ``ngram_entries``)."""
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


def ngram_entries(
    tokens: Sequence[int], config: StoreConfig, start: int = 0, partial: bool = False
) -> Iterator[tuple[Continuation, Continuation]]:
    """(context, continuation) for every position ``end >= start`` of the sequence followed by a whole
    span (``partial``: by at least one token, for short n-grams such as Jacobi harvests), contexts
    min_n..max_n long ending at ``end``, in a fixed order (both backends apply them in this order).
    ``start`` lets a sequence that grows be added piece by piece, each position counted once."""
    tokens = [int(t) for t in tokens]
    last = len(tokens) - (1 if partial else config.span)
    for end in range(max(config.min_n, start), last + 1):
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
    """The store in this process's memory (thread-safe: a learner thread may add while drafting reads).

    ``max_contexts`` bounds its size: past it, the least recently updated contexts are dropped
    (None = unbounded; Redis bounds itself with TTLs and its own ``maxmemory-policy``)."""

    def __init__(self, config: StoreConfig | None = None, namespace: str = "default",
                 max_contexts: int | None = None) -> None:
        self.config = config or StoreConfig()
        self.namespace = namespace
        self.max_contexts = max_contexts
        self._table: OrderedDict[Continuation, dict[bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int], start: int = 0, partial: bool = False) -> None:
        _check(tokens)
        entries = list(ngram_entries(tokens, self.config, start, partial))
        with self._lock:
            for ctx, cont in entries:
                counts = self._table.get(ctx)
                if counts is None:
                    counts = self._table[ctx] = {}
                elif self.max_contexts is not None:
                    self._table.move_to_end(ctx)
                member = pack(cont)
                counts[member] = counts.get(member, 0) + 1
                if len(counts) > self.config.top_n:
                    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
                    for member, _ in ranked[: len(counts) - self.config.top_n]:
                        del counts[member]
            while self.max_contexts is not None and len(self._table) > self.max_contexts:
                self._table.popitem(last=False)

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        for n in range(min(self.config.max_n, len(context)), self.config.min_n - 1, -1):
            key = tuple(int(t) for t in context[len(context) - n :])
            with self._lock:
                counts = self._table.get(key)
                ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:k] if counts else None
            if ranked:
                return [(unpack(m), c) for m, c in ranked]
        return []

    def __len__(self) -> int:
        return len(self._table)

    # ----------------------------------------------------------- snapshots
    def save(self, path: str | Path) -> None:
        """Write the store to a file (gzip'd JSON: config, namespace, every context's counts), whole or not at
        all: a failed write (a full disk) raises OSError and leaves the file that was there readable."""
        with self._lock:
            table = {pack(ctx).hex(): {m.hex(): c for m, c in counts.items()} for ctx, counts in self._table.items()}
        doc = {"format": SNAPSHOT_FORMAT, "config": dataclasses.asdict(self.config), "namespace": self.namespace,
               "table": table}
        with atomic_write(path) as raw, gzip.open(raw, "wt", encoding="utf-8") as f:
            json.dump(doc, f)

    @classmethod
    def load(cls, path: str | Path) -> MemoryNGramStore:
        """Read a file written by ``save``; ValueError if it is not one."""
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not an n-gram store snapshot ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"{path}: not an n-gram store snapshot (format {SNAPSHOT_FORMAT!r} expected)")
        try:
            store = cls(StoreConfig(**doc["config"]), doc["namespace"])
            store._table = OrderedDict(
                (unpack(bytes.fromhex(ctx)), {bytes.fromhex(m): int(c) for m, c in counts.items()})
                for ctx, counts in doc["table"].items())
        except (KeyError, TypeError, ValueError, AttributeError, struct.error) as exc:
            raise ValueError(f"{path}: damaged n-gram store snapshot ({type(exc).__name__}: {exc})") from None
        return store


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
                 batch: int = 512, url: str | None = None) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("the namespace may not contain braces (they mark Redis Cluster hash tags)")
        self.client = client
        self.config = config or StoreConfig()
        self.namespace = namespace
        self.batch = batch  # script calls per pipeline round trip
        self._update = client.register_script(_UPDATE)
        self._config_checked = False
        self.url = url  # the Redis URL it was opened from, if any: for what opens its own connections to it (the
        # suffix proposer's fleet log)

    @classmethod
    def from_url(cls, url: str, config: StoreConfig | None = None, namespace: str = "default",
                 timeout_s: float = 0.5) -> RedisNGramStore:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, config, namespace, url=url)

    def key(self, context: Sequence[int]) -> str:
        return f"specmesh:{self.namespace}:ng:{{{pack(context).hex()}}}"

    def check_config(self) -> None:
        """Record this store's n-gram options in Redis, or ValueError if the namespace holds n-grams
        made with other ones (a drafter whose contexts or spans differ from the ingested corpus)."""
        if self._config_checked:
            return
        mine = json.dumps(dataclasses.asdict(dataclasses.replace(self.config, ttl_s=0)), sort_keys=True)
        key = f"specmesh:{self.namespace}:config:{{config}}"
        self.client.set(key, mine, nx=True)
        theirs = self.client.get(key)
        if theirs is not None and theirs.decode() != mine:
            raise ValueError(f"the Redis store {self.namespace} was filled with other n-gram options: {theirs.decode()}")
        self._config_checked = True

    def add(self, tokens: Sequence[int], start: int = 0, partial: bool = False) -> None:
        _check(tokens)
        self.check_config()
        args = (self.config.top_n, self.config.ttl_s)
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for ctx, cont in ngram_entries(tokens, self.config, start, partial):
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

    def add(self, tokens: Sequence[int], start: int = 0, partial: bool = False) -> None:
        self.fallback.add(tokens, start, partial)
        if self._usable():
            try:
                self.primary.add(tokens, start, partial)
            except Exception as exc:  # any backend failure: carry on in memory
                self._failed(exc)

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[Continuation, int]]:
        if self._usable():
            try:
                return self.primary.lookup(context, k)
            except Exception as exc:
                self._failed(exc)
        return self.fallback.lookup(context, k)


def open_store(spec: str | None, namespace: str = "default", config: StoreConfig | None = None) -> NGramStore:
    """The store a drafter uses, from its configuration:

    - None or ``memory``: an empty in-memory store;
    - ``redis://...`` / ``rediss://...`` / ``unix://...``: Redis, falling back to memory while it is down;
    - a file path: an in-memory store loaded from a snapshot (``specmesh ingest --out``), which must have
      been built with the same tokenizer (``namespace``) unless ``namespace`` is "default".
    """
    if spec is None or spec == "memory":
        return MemoryNGramStore(config, namespace, MEMORY_MAX_CONTEXTS)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        primary = RedisNGramStore.from_url(spec, config, namespace)
        try:
            primary.check_config()
        except ValueError:
            raise
        except Exception as exc:  # Redis down at start: the fallback store takes over, checked on reconnect
            log.warning("n-gram store %s not reachable yet (%s: %s)", spec, type(exc).__name__, exc)
        return FallbackNGramStore(primary, MemoryNGramStore(primary.config, namespace, MEMORY_MAX_CONTEXTS))
    store = MemoryNGramStore.load(spec)
    if namespace != "default" and store.namespace != namespace:
        raise ValueError(f"{spec}: built for tokenizer {store.namespace}, not this model's {namespace}")
    store.max_contexts = max(len(store), MEMORY_MAX_CONTEXTS)  # learning on top of it stays bounded
    return store


class StoreLearner:
    """Adds token sequences to a store on a background thread, off the drafting path.

    ``submit`` never blocks: when ``max_pending`` sequences wait already, the new one is dropped
    (and counted). Store failures are logged and counted, never raised to the submitter. The
    thread starts with the first submission and ends after ``idle_s`` without work, so idle
    proposers hold no thread."""

    def __init__(self, store: NGramStore, max_pending: int = 4096, idle_s: float = 30.0) -> None:
        self.store = store
        self.dropped = 0
        self.failures = 0
        self.idle_s = idle_s
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, tokens: Sequence[int], start: int = 0, partial: bool = False) -> None:
        try:
            self._queue.put_nowait((list(tokens), start, partial))
        except queue.Full:
            self.dropped += 1
            return
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:  # the thread clears _thread under this lock, only with an empty queue
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ngram-learner", daemon=True)
                self._thread.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is in the store; False on timeout."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        self._ensure_thread()
        return done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.store.add(*item)
            except Exception as exc:  # a store failure must not end learning
                self.failures += 1
                log.warning("n-gram learner: %s: %s", type(exc).__name__, exc)
