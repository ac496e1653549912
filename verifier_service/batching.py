"""Continuous batching: many callers, one model thread, one forward per step for everyone.

``BatchingVerifier`` is the Verifier (``specmesh.contract``) that the gRPC service and
the embedded engines share. Callers on any thread submit Prefill / Verify / Release and
block on a future; one scheduler thread owns the LocalVerifier and loops:

1. apply releases (their blocks go back to the pool first),
2. admit waiting prefills in arrival order while the KV pool can reserve them (a
   request that must wait sits in a bounded queue; beyond ``max_waiting`` waiting, or
   when it could never fit in the pool, it gets ``CapacityError`` = RESOURCE_EXHAUSTED),
3. build one step: every pending Verify (decode first: they are the latency), then the
   next prompt chunk of prefilling sessions while the step's token budget
   (``max_batch_tokens``) lasts, so a long prompt never stalls the others,
4. run it (``LocalVerifier.step``) and resolve the futures.

A session's calls are sequential (the orchestrator drafts between two Verifys), so a
step holds each session at most once. Without care the sessions split into cohorts:
those answered by step k come back while step k + 1 already runs the others, and every
step carries half of them. So when fewer Verifys are pending than sessions decode, the
scheduler waits for the rest, but never longer than half the last step's time (nor
``max_wait_ms``): a straggler costs the others at most that, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from specmesh.contract import CapacityError, PrefillResult, VerifyCosts, VerifyResult
from specmesh.metrics import COUNT_BUCKETS, SECONDS_BUCKETS, Buckets
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.arguments import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAITING
from verifier_service.verifier import LocalVerifier

DEFAULT_MAX_WAIT_MS = 5.0
log = logging.getLogger("specmesh.batching")


def _claim(future: Future) -> bool:
    """Mark a call as running; False if its caller cancelled it (then it is skipped). A running future can no
    longer be cancelled, so its result can always be set."""
    return future.done() is False and future.set_running_or_notify_cancel()


def _settle(future: Future, result=None, exc: BaseException | None = None) -> None:
    """Resolve a call unless its caller cancelled it meanwhile."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled (or settled) by then: nobody is waiting
        pass


@dataclass
class _Prefill:
    session_id: str
    prompt: list[int]
    sampling: SamplingParams
    future: Future
    features: bool = False  # report the session's target features
    started: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """What the scheduler did (read by benchmarks and /metrics). Written by the scheduler thread only."""

    steps: int = 0
    verified: int = 0  # Verify calls served
    prefill_chunks: int = 0
    max_batch: int = 0  # most Verify calls in one step
    verify_rows: int = 0  # rows of the Verify calls: the pending token + the tree's nodes each
    prefills: int = 0  # prefills finished
    prefill_tokens: int = 0  # prompt tokens run (every chunk)
    # per step, for /metrics (verifier_service/metrics.py): sessions and rows in the forward, its seconds
    batch_sessions: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    batch_rows: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    step_seconds: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))

    def record(self, seconds: float, num_verifies: int, verify_rows: int, num_chunks: int, chunk_tokens: int,
               num_prefilled: int) -> None:
        """One step that ran: ``num_chunks`` prompt chunks of ``chunk_tokens`` tokens in all, ``num_prefilled``
        of which finished their prefill."""
        self.steps += 1
        self.verified += num_verifies
        self.max_batch = max(self.max_batch, num_verifies)
        self.verify_rows += verify_rows
        self.prefill_chunks += num_chunks
        self.prefill_tokens += chunk_tokens
        self.prefills += num_prefilled
        self.batch_sessions.observe(num_verifies + num_chunks)
        self.batch_rows.observe(verify_rows + chunk_tokens)
        self.step_seconds.observe(seconds)

    @property
    def mean_batch(self) -> float:
        return self.verified / self.steps if self.steps else 0.0


class BatchingVerifier:
    """Thread-safe Verifier over a LocalVerifier, batching the calls of all threads (see module doc)."""

    def __init__(self, verifier: LocalVerifier, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_waiting: int = DEFAULT_MAX_WAITING, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 costs: VerifyCosts | None = None) -> None:
        """``costs``: the forward's measured costs (``LocalVerifier.profile_costs``), which the orchestrator's
        load-aware policy sizes trees with; None = not measured (trees are not capped by load)."""
        if max_batch_tokens < 1 or max_waiting < 0:
            raise ValueError(f"max_batch_tokens must be >= 1 and max_waiting >= 0, got {max_batch_tokens}, "
                             f"{max_waiting}")
        self.verifier = verifier
        self.costs = costs
        self.info = verifier.info
        self.max_tree_nodes = verifier.max_tree_nodes
        self.max_batch_tokens, self.max_waiting = max_batch_tokens, max_waiting
        self.max_wait = max_wait_ms / 1e3
        self._step_seconds = 0.0  # moving average of a step's time: bounds the wait for stragglers
        self._decoding: set[str] = set()  # prefill done, not released: the Verifys a step may expect
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._waiting: deque[_Prefill] = deque()  # not admitted yet (the pool is full)
        self._prefilling: dict[str, _Prefill] = {}  # admitted, prompt chunks still to run
        self._verifies: dict[str, tuple[TokenTree, Future]] = {}
        self._releases: list[tuple[str, Future]] = []
        self._sessions: set[str] = set()  # admitted or waiting, not released: what num_sessions counts
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="verifier-scheduler", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- protocol
    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                features: bool = False) -> PrefillResult:
        return self.submit_prefill(session_id, prompt, sampling, features).result()

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        return self.submit_verify(session_id, tree).result()

    def verify_batch(self, requests: Sequence[tuple[str, TokenTree]]) -> list[VerifyResult | Exception]:
        futures = [self.submit_verify(sid, tree) for sid, tree in requests]
        return [f.exception() or f.result() for f in futures]

    def release(self, session_id: str) -> None:
        self.submit_release(session_id).result()

    # ------------------------------------------------------------ submission
    def submit_prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                       features: bool = False) -> Future:
        """``features``: report the session's target features (``LocalVerifier.admit``)."""
        future: Future = Future()
        prompt = list(prompt)
        try:  # a bad request is INVALID_ARGUMENT before any capacity answer (reads only fixed configuration)
            self.verifier.check_request(prompt, sampling)
        except ValueError as exc:
            future.set_exception(exc)
            return future
        need = self._blocks_needed(len(prompt), sampling)
        with self._cond:
            self._check_open()
            if session_id in self._sessions:
                future.set_exception(ValueError(f"session {session_id!r} already exists"))
            elif need > self.verifier.allocator.num_blocks:
                future.set_exception(CapacityError(
                    f"the request needs {need} KV blocks (prompt + max_new_tokens + the largest tree), more than "
                    f"the whole pool has ({self.verifier.allocator.num_blocks}); raise --kv-cache-gb"))
            elif len(self._waiting) >= self.max_waiting and not self._could_admit_now(len(prompt), sampling):
                future.set_exception(CapacityError(
                    f"the verifier is full: {len(self._waiting)} requests already wait for KV blocks"))
            else:
                self._sessions.add(session_id)
                self._waiting.append(_Prefill(session_id, prompt, sampling, future, features))
                self._cond.notify()
        return future

    def submit_verify(self, session_id: str, tree: TokenTree) -> Future:
        future: Future = Future()
        with self._cond:
            self._check_open()
            if session_id in self._verifies:
                future.set_exception(ValueError(f"session {session_id!r} already has a Verify in flight"))
            else:
                self._verifies[session_id] = (tree, future)
                self._cond.notify()
        return future

    def submit_release(self, session_id: str) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                future.set_result(None)
                return future
            self._releases.append((session_id, future))
            self._cond.notify()
        return future

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread still runs (it ends at ``close`` or on a bug)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the scheduler; calls still queued fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ----------------------------------------------------------------- state
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_session(self, session_id: str) -> bool:
        """Admitted or waiting, and not released."""
        with self._cond:
            return session_id in self._sessions

    def session_ids(self) -> list[str]:
        with self._cond:
            return list(self._sessions)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the verifier is closed")

    def _could_admit_now(self, prompt_len: int, sampling: SamplingParams) -> bool:
        return not self._waiting and self.verifier.can_admit(prompt_len, sampling)

    # ------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # a bug here must not leave every caller hanging
                log.exception("verifier scheduler step failed")

    def _iterate(self) -> bool:
        """One scheduling round; False once closed."""
        with self._cond:
            while not (self._closed or self._releases or self._verifies or self._prefilling
                       or (self._waiting and self._admissible())):
                self._cond.wait()
            self._gather_stragglers()
            if self._closed:
                self._fail_all(RuntimeError("the verifier is closed"))
                return False
            releases, self._releases = self._releases, []
            for session_id, _ in releases:
                self._sessions.discard(session_id)
                self._decoding.discard(session_id)
                gone = RuntimeError(f"session {session_id!r} was released")
                self._drop_waiting(session_id, gone)
                request = self._prefilling.pop(session_id, None)
                _, verify = self._verifies.pop(session_id, (None, None))
                for future in (request.future if request else None, verify):
                    if future is not None:
                        _settle(future, exc=gone)
        for session_id, future in releases:
            self.verifier.release(session_id)
            _settle(future)
        with self._cond:
            self._admit()
            verifies = {sid: (tree, f) for sid, (tree, f) in self._verifies.items() if _claim(f)}
            self._verifies = {}
            prefills = self._pick_prefills(sum(tree.num_nodes + 1 for tree, _ in verifies.values()))
        if verifies or prefills:
            self._run(prefills, verifies)
        return True

    def _gather_stragglers(self) -> None:
        """Under the lock, with work pending: while only some decoding sessions have their Verify in, wait
        for the others up to min(max_wait, half a step) (see module doc)."""
        if not self._verifies or self._prefilling or self._releases:
            return
        deadline = time.monotonic() + min(self.max_wait, 0.5 * self._step_seconds)
        while (len(self._verifies) < len(self._decoding) and not self._closed
               and (remaining := deadline - time.monotonic()) > 0):
            self._cond.wait(remaining)

    def _admissible(self) -> bool:
        head = self._waiting[0]
        return self.verifier.can_admit(len(head.prompt), head.sampling)

    def _blocks_needed(self, prompt_len: int, sampling: SamplingParams) -> int:
        return self.verifier.allocator.blocks_for(self.verifier.reservation(prompt_len, sampling))

    def _admit(self) -> None:
        """Admit waiting prefills in arrival order while the pool can reserve them (under the lock)."""
        while self._waiting:
            head = self._waiting[0]
            if head.future.cancelled():  # its caller went away while it waited
                self._waiting.popleft()
                self._sessions.discard(head.session_id)
                continue
            if not self.verifier.can_admit(len(head.prompt), head.sampling):
                return  # wait for blocks; later arrivals do not overtake it
            self._waiting.popleft()
            if not _claim(head.future):
                self._sessions.discard(head.session_id)
                continue
            try:
                self.verifier.admit(head.session_id, head.prompt, head.sampling, head.features)
            except Exception as exc:  # an invalid request
                self._sessions.discard(head.session_id)
                _settle(head.future, exc=exc)
                continue
            self._prefilling[head.session_id] = head

    def _pick_prefills(self, verify_tokens: int) -> list[str]:
        """Prefilling sessions whose next chunk fits the step's token budget (at least one if nothing else)."""
        budget = self.max_batch_tokens - verify_tokens
        chosen = []
        for session_id, request in self._prefilling.items():
            chunk = min(self.verifier.prefill_chunk, len(request.prompt))
            if chosen or verify_tokens:
                if chunk > budget:
                    break
            chosen.append(session_id)
            budget -= chunk
        return chosen

    def _run(self, prefills: list[str], verifies: dict[str, tuple[TokenTree, Future]]) -> None:
        requests = [(sid, tree) for sid, (tree, _) in verifies.items()]
        chunk_tokens = sum(self.verifier.next_chunk(sid) for sid in prefills)
        started = time.perf_counter()
        try:
            firsts, results = self.verifier.step(prefills, requests)
        except Exception as exc:  # a model failure: every call of the step gets it
            log.exception("batched step failed")
            for _, future in verifies.values():
                _settle(future, exc=exc)
            with self._cond:
                for session_id in prefills:
                    request = self._prefilling.pop(session_id)
                    self._sessions.discard(session_id)
                    self.verifier.release(session_id)
                    _settle(request.future, exc=exc)
            return
        seconds = time.perf_counter() - started
        self._step_seconds = 0.8 * self._step_seconds + 0.2 * seconds
        self.stats.record(seconds, len(requests), sum(tree.num_nodes + 1 for _, tree in requests), len(prefills),
                          chunk_tokens, len(firsts))
        for (_, future), result in zip(verifies.values(), results, strict=True):
            if isinstance(result, Exception):
                _settle(future, exc=result)
            else:
                _settle(future, result)
        with self._cond:
            for session_id, first in firsts.items():
                self._decoding.add(session_id)
                request = self._prefilling.pop(session_id)
                _settle(request.future, PrefillResult(first, time.perf_counter() - request.started,
                                                      self.verifier.take_prompt_features(session_id)))

    def _drop_waiting(self, session_id: str, exc: Exception) -> None:
        for request in list(self._waiting):
            if request.session_id == session_id:
                self._waiting.remove(request)
                if not request.future.cancelled():
                    _settle(request.future, exc=exc)

    def _fail_all(self, exc: Exception) -> None:
        for request in [*self._waiting, *self._prefilling.values()]:
            if not request.future.cancelled():
                _settle(request.future, exc=exc)
        for _, future in self._verifies.values():
            if not future.cancelled():
                _settle(future, exc=exc)
        for _, future in self._releases:
            _settle(future)
        self._waiting.clear()
        self._prefilling.clear()
        self._verifies.clear()
        self._releases.clear()
