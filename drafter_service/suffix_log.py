"""The fleet's corpus for suffix decoding: a Redis stream of every output the drafter replicas' ``suffix``
proposers learned from, replayed when a replica starts and followed while it runs.

Each replica appends the outputs of the sessions it closes (``publish``: one stream entry per output, its token
ids as little-endian int32 bytes and the replica's id; off the caller's thread, through a bounded queue) and a
follower thread reads the stream from its start (``XREAD BLOCK``), adding the other replicas' outputs to its
global index, so a request routed to any replica finds what any replica wrote, and a restarted replica has the
fleet's recent outputs again. The stream is capped (``XADD MAXLEN ~``) at about as many entries as the global
index keeps tokens for, and namespaced by tokenizer (the n-gram store's namespace), so two models never share
one. Redis going away costs nothing but the sharing: the local index keeps serving, publishing drops (counted),
and the follower retries with backoff and resumes after the last entry it read.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid

import numpy as np

from drafter_service.suffix_index import SuffixIndex

log = logging.getLogger(__name__)

KEY_PREFIX = "specmesh:suffix:"
TOKENS_PER_ENTRY = 128  # the cap's guess of an output's length: entries kept = global tokens / this
BLOCK_MS = 1000  # a follower's XREAD waits this long for new entries before it checks its stop flag
RETRY_S = (0.5, 10.0)  # the follower's backoff while Redis is down: first and longest wait


def stream_key(namespace: str) -> str:
    return f"{KEY_PREFIX}{namespace}"


class SuffixLog:
    """Publishes this replica's outputs to the fleet's stream and feeds the other replicas' into ``index``.

    ``client``: a ``redis.Redis`` (bytes responses). ``follow=False``: publish only (no follower thread)."""

    def __init__(self, client, namespace: str, index: SuffixIndex, max_entries: int, follow: bool = True,
                 max_pending: int = 1024) -> None:
        self.client = client
        self.key = stream_key(namespace)
        self.index = index
        self.max_entries = max(1, max_entries)
        self.replica = uuid.uuid4().hex.encode()
        self.published = self.received = self.dropped = self.failures = 0
        self.last_id = b"0-0"  # the follower replays the stream from its start
        self._pending: queue.Queue = queue.Queue(max_pending)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._publish_loop, name="suffix-log-publish", daemon=True)]
        if follow:
            self._threads.append(threading.Thread(target=self._follow_loop, name="suffix-log-follow", daemon=True))
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_url(cls, url: str, namespace: str, index: SuffixIndex, max_entries: int, **kw) -> SuffixLog:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=BLOCK_MS / 1000 + 5, socket_connect_timeout=5)
        return cls(client, namespace, index, max_entries, **kw)

    def publish(self, tokens) -> None:
        """Queue an output for the stream (never blocks: a full queue drops it, counted)."""
        try:
            self._pending.put_nowait(np.asarray(tokens, "<i4").tobytes())
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads (what is still queued is published first, within the timeout)."""
        self._pending.put(None)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _publish_loop(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            try:
                self.client.xadd(self.key, {b"r": self.replica, b"t": item}, maxlen=self.max_entries,
                                 approximate=True)
                self.published += 1
            except Exception as exc:  # Redis down: this output stays local
                self.dropped += 1
                self._warn("publish", exc)

    def _follow_loop(self) -> None:
        wait = RETRY_S[0]
        while not self._stop.is_set():
            try:
                answer = self.client.xread({self.key: self.last_id}, count=256, block=BLOCK_MS)
            except Exception as exc:
                self._warn("follow", exc)
                self._stop.wait(wait)
                wait = min(RETRY_S[1], 2 * wait)
                continue
            wait = RETRY_S[0]
            for _, entries in answer or ():
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    if fields.get(b"r") != self.replica and fields.get(b"t"):
                        self.index.add(np.frombuffer(fields[b"t"], "<i4"))
                        self.received += 1

    def _warn(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("suffix log %s (%s): %s: %s (%d failures so far; the local index keeps serving)",
                        what, self.key, type(exc).__name__, exc, self.failures)
