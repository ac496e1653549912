"""The step loop: one thread owns a LocalVerifier and runs one forward per step for every session on it.

Every deployment steps its target here. A ``StepLoop`` serves two kinds of sessions at once:

- **calls** (the gRPC verifier service, ``specmesh verifier`` and its Ray replicas; the per-request engine in
  tests and the ``threads`` benchmark): callers on any thread submit Prefill / Verify / Release and wait on a
  future; a Verify's tree is the caller's.
- **driven requests** (the engine core, orchestrator/core.py, the ``driver``): requests opened with ``open``
  whose trees the driver drafts on this thread at the start of every step and whose results it commits at
  its end, with no thread and no future of their own.

One round of the loop:

1. run the functions queued with ``call_soon`` (a driver's cancels) and apply releases (their blocks go back
   to the pool first; a Prefill or Verify of a released session still waiting ends with
   ``SessionReleasedError``),
2. resume preempted sessions, oldest admission first, then admit waiting sessions in arrival order, while the
   KV pool has their blocks free (a resumed session its tokens', a new one its prompt's) with a small watermark
   to spare; a session that must wait sits in a bounded queue (beyond ``max_waiting`` waiting it gets
   ``CapacityError`` = RESOURCE_EXHAUSTED),
3. ``step``: the driver's trees and every pending Verify (decode first: they are the latency), then the next
   prompt chunk of prefilling (or resumed) sessions while the step's token budget (``max_batch_tokens``)
   lasts, so a long prompt never stalls the others; when the pool lacks the blocks the step's rows write,
   **preemption**: the most recently admitted session gives all its blocks back and leaves the step, until the
   rest fit (it resumes at a later round and computes its positions again; its tree, or its caller's Verify,
   waits for it); one forward with acceptance for all (``LocalVerifier.step``); then the driver commits its
   results and the callers' futures resolve.

A step runs as soon as there is work: the driver's requests never wait. A caller's calls are sequential (it
drafts between two Verifys) and arrive over the network at their own pace, so without care they split into
cohorts: those answered by step k come back while step k + 1 already runs the others, and every step carries
half of them. So when the driver has nothing to step and fewer Verifys are pending than called sessions
decode, the loop waits for the rest, but never longer than half the last step's time (nor ``max_wait_ms``): a
straggler costs the others at most that, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from specmesh.contract import (
    CapacityError,
    PrefillResult,
    SessionPreemptedError,
    SessionReleasedError,
    VerifyCosts,
    VerifyResult,
)
from specmesh.metrics import COUNT_BUCKETS, SECONDS_BUCKETS, Buckets
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.arguments import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAITING
from verifier_service.costs import StepCosts

if TYPE_CHECKING:  # the loop only calls it: importing it (torch) is its owner's business
    from verifier_service.lookahead import LookaheadConfig
    from verifier_service.verifier import LocalVerifier

DEFAULT_MAX_WAIT_MS = 5.0
_PREEMPTED = SessionPreemptedError("the session was preempted for this step's KV blocks; its tree steps once it resumes")
log = logging.getLogger("specmesh.step_loop")


class SessionOwner(Protocol):
    """Who hears how a session's admission and prefill went: a caller's future (``submit_prefill``) or the
    driver's request (``open``). Called on the loop thread, without the loop's lock."""

    def admitted(self) -> bool:
        """Its KV blocks are reserved and its prefill starts; False: its caller went away (it is dropped)."""

    def prefilled(self, result: PrefillResult) -> None:
        """The prefill finished: the first token (and the prompt's features, when asked)."""

    def failed(self, exc: BaseException) -> None:
        """It never got (or lost) its session: refused, released while it waited, the step failed, closed."""

    def abandoned(self) -> bool:
        """Its caller went away while it waited for blocks (it is skipped)."""

    def preempted(self) -> None:
        """Its decoding session gave its KV blocks back (the pool ran short): it cannot step until ``resumed``."""

    def resumed(self) -> None:
        """Its preempted session has its KV back (recomputed): it steps again."""


class StepDriver(Protocol):
    """The requests a loop steps without calls: the engine core (orchestrator/core.py). Called on the loop
    thread; ``pending`` under the loop's lock (it must neither lock nor block)."""

    def pending(self) -> bool:
        """Whether it has decoding requests to step now."""

    @property
    def num_running(self) -> int:
        """Its decoding requests (preempted ones and any sitting a step out included): the batch a step would
        have if every one of them stepped (``BatchStats.decoding``)."""

    def draft(self) -> list[tuple[str, TokenTree]]:
        """Each of its decoding sessions and its tree for this step, drafted now or ahead (it may start drafting
        the next step's trees elsewhere, to run while the forward does)."""

    def waiting(self) -> None:
        """The step is launched (``LocalVerifier.launch``: on a GPU its forward, decisions and one copy are queued;
        on the CPU it ran) and the loop thread only waits for its copy (``finish``): start what should run
        meanwhile. Called at most once per ``draft``, not for a step with no rows."""

    def commit(self, results: Sequence[VerifyResult | Exception]) -> None:
        """The forward is over: the result of each session ``draft`` returned, in its order (an exception: that
        session's alone, or the step's failure for all)."""

    def stop(self, exc: BaseException) -> None:
        """End every request it holds with ``exc`` (the loop closes, or a step failed on a bug)."""


class _CallerOwner:
    """A ``submit_prefill`` caller's future as a SessionOwner."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def admitted(self) -> bool:
        return _claim(self.future)

    def prefilled(self, result: PrefillResult) -> None:
        _settle(self.future, result)

    def failed(self, exc: BaseException) -> None:
        if not self.future.cancelled():
            _settle(self.future, exc=exc)

    def abandoned(self) -> bool:
        return self.future.cancelled()

    def preempted(self) -> None:  # the caller's Verify waits in the loop meanwhile
        pass

    def resumed(self) -> None:
        pass


@dataclass
class _Opening:
    """A session from submission to the end of its prefill."""

    session_id: str
    prompt: list[int]
    sampling: SamplingParams
    owner: SessionOwner
    features: bool = False  # report the session's target features
    feedback_topk: int | None = None  # its feedback (None: the verifier's settings; ``LocalVerifier.admit``)
    lookahead: LookaheadConfig | None = None
    driven: bool = False  # the driver's (no Verify calls: never waited for as a straggler)
    blocks: int = 0  # KV blocks its admission takes (set when queued)
    started: float = field(default_factory=time.perf_counter)


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
class BatchStats:
    """What the loop did (read by benchmarks and /metrics). Written by the loop thread only."""

    steps: int = 0
    verified: int = 0  # Verify calls served
    prefill_chunks: int = 0
    max_batch: int = 0  # most Verify calls in one step
    verify_rows: int = 0  # rows of the Verify calls: the pending token + the tree's nodes each
    prefills: int = 0  # prefills finished
    prefill_tokens: int = 0  # prompt tokens run (every chunk)
    preemptions: int = 0  # sessions that gave their KV blocks back for a step's rows
    # the steps with a session decoding (not prefill-only), the sessions decoding summed over them (the driver's
    # running requests and the called sessions past their prefill: in the step or not), and the share of them
    # each step verified, summed: ``stepped_per_running`` below 1 means decoding sessions sat steps out
    decode_steps: int = 0
    decoding: int = 0
    stepped_share: float = 0.0
    # per step, for /metrics (verifier_service/metrics.py): sessions and rows in the forward, its seconds
    batch_sessions: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    batch_rows: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    step_seconds: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))

    def record(self, seconds: float, num_verifies: int, verify_rows: int, num_chunks: int, chunk_tokens: int,
               num_prefilled: int, num_decoding: int | None = None) -> None:
        """One step that ran: ``num_chunks`` prompt chunks of ``chunk_tokens`` tokens in all, ``num_prefilled``
        of which finished their prefill; ``num_decoding``: the sessions decoding when it began, in it or not (None:
        not known, the step is not counted among the decode steps)."""
        self.steps += 1
        if num_decoding:
            self.decode_steps += 1
            self.decoding += num_decoding
            self.stepped_share += num_verifies / num_decoding
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
        """Verify calls per forward, over every step (prefill-only ones included)."""
        return self.verified / self.steps if self.steps else 0.0

    @property
    def stepped_per_running(self) -> float:
        """The mean over decode steps of the share of the decoding sessions that stepped (1: none sat out)."""
        return self.stepped_share / self.decode_steps if self.decode_steps else 0.0


class StepLoop:
    """One thread stepping every session of a LocalVerifier: the callers' (thread-safe, futures) and the driver's
    (see module doc). Also the Verifier protocol (``specmesh.contract``) for callers that block."""

    def __init__(self, verifier: LocalVerifier, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_waiting: int = DEFAULT_MAX_WAITING, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 costs: VerifyCosts | None = None, driver: StepDriver | None = None,
                 name: str = "step-loop") -> None:
        """``max_batch_tokens``: rows of one forward (prompt chunks fill what the trees leave); ``max_waiting``:
        sessions waiting for KV blocks before the next is refused; ``max_wait_ms``: the longest wait for a
        straggling Verify; ``costs``: the forward's measured costs (``LocalVerifier.profile_costs``), which the
        orchestrator's load-aware policy sizes trees with (None: not measured, trees not capped by load), kept
        as ``self.costs``, a ``StepCosts`` refitted to the steps this loop runs (verifier_service/costs.py);
        ``driver``: the requests stepped without calls (at most one; None: calls only)."""
        if max_batch_tokens < 1 or max_waiting < 0:
            raise ValueError(f"max_batch_tokens must be >= 1 and max_waiting >= 0, got {max_batch_tokens}, "
                             f"{max_waiting}")
        self.verifier = verifier
        self.costs = None if costs is None else costs if isinstance(costs, StepCosts) else StepCosts(costs)
        self.driver = driver
        self.info = verifier.info
        self.max_tree_nodes = verifier.max_tree_nodes
        self.max_batch_tokens, self.max_waiting = max_batch_tokens, max_waiting
        self.max_wait = max_wait_ms / 1e3
        self._step_seconds = 0.0  # moving average of a step's time: bounds the wait for stragglers
        self._decoding: set[str] = set()  # called sessions past their prefill, not released: the Verifys to expect
        self.stats = BatchStats()
        self._cond = threading.Condition()  # reentrant: owners and the driver may call back in on the loop thread
        self._waiting: deque[_Opening] = deque()  # not admitted yet (the pool is full)
        self._prefilling: dict[str, _Opening] = {}  # admitted, prompt chunks still to run
        self._verifies: dict[str, tuple[TokenTree, Future]] = {}
        self._releases: list[tuple[str, Future]] = []
        self._soon: list[Callable[[], None]] = []  # call_soon
        self._sessions: set[str] = set()  # admitted or waiting, not released: what num_sessions counts
        # preemption (module doc): admission order of every admitted session (the newest is preempted first), the
        # preempted ones (resumed oldest first), decoding sessions computing their KV again, Verifys that wait for
        # their session to resume, and each admitted session's owner
        self._admitted = 0
        self._order: dict[str, int] = {}
        self._paused: dict[str, int] = {}
        self._resuming: set[str] = set()
        self._parked: dict[str, tuple[TokenTree, Future]] = {}
        self._owners: dict[str, SessionOwner] = {}
        # the Verifys (their futures) that end instead of waiting if their session is preempted: per call, not per
        # session, as the call that ended so may be sent again before the step that ended it is over
        self._no_wait: set[Future] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- protocol
    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                features: bool = False) -> PrefillResult:
        return self.submit_prefill(session_id, prompt, sampling, features).result()

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        return self.submit_verify(session_id, tree).result()

    def verify_batch(self, requests: Sequence[tuple[str, TokenTree]]) -> list[VerifyResult | Exception]:
        futures = self.submit_verifies(requests)
        return [f.exception() or f.result() for f in futures]

    def release(self, session_id: str) -> None:
        self.submit_release(session_id).result()

    # ------------------------------------------------------------ calls
    def submit_prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                       features: bool = False) -> Future:
        """``features``: report the session's target features (``LocalVerifier.admit``)."""
        future: Future = Future()
        try:
            self._enqueue(_Opening(session_id, list(prompt), sampling, _CallerOwner(future), features))
        except (ValueError, CapacityError) as exc:
            future.set_exception(exc)
        return future

    def submit_verify(self, session_id: str, tree: TokenTree) -> Future:
        return self.submit_verifies([(session_id, tree)])[0]

    def submit_verifies(self, requests: Sequence[tuple[str, TokenTree]], wait_if_preempted: bool = True
                        ) -> list[Future]:
        """One future per (session, tree); Verifys submitted together join the same step (a VerifyBatch call).
        ``wait_if_preempted``: a Verify whose session is (or gets) preempted waits for it to resume; False: it ends
        at once with ``SessionPreemptedError``, to be sent again (a VerifyBatch: its other items must not wait for
        that session, whose blocks their own steps may have to free)."""
        futures = []
        with self._cond:
            self._check_open()
            for session_id, tree in requests:
                future: Future = Future()
                if session_id in self._verifies:
                    future.set_exception(ValueError(f"session {session_id!r} already has a Verify in flight"))
                else:
                    self._verifies[session_id] = (tree, future)
                    if not wait_if_preempted:
                        self._no_wait.add(future)
                futures.append(future)
            self._cond.notify()
        return futures

    def submit_release(self, session_id: str) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                future.set_result(None)
                return future
            self._releases.append((session_id, future))
            self._cond.notify()
        return future

    # ------------------------------------------------------------ the driver's
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams, owner: SessionOwner,
             features: bool = False, feedback_topk: int | None = None,
             lookahead: LookaheadConfig | None = None) -> None:
        """Queue a session of the driver's, from any thread: ``owner`` hears of its admission and prefill; then
        the driver steps it until it ``drop``s it. ``features``, ``feedback_topk``, ``lookahead``: what it asks of
        the verifier (``LocalVerifier.admit``). ValueError (bad input or id), CapacityError (larger than the
        whole pool, or too many waiting), RuntimeError (closed) for one that cannot wait."""
        self.verifier.session_feedback(feedback_topk, lookahead)  # a window too large is refused now, not later
        self._enqueue(_Opening(session_id, list(prompt), sampling, owner, features, feedback_topk, lookahead,
                               driven=True))

    def drop(self, session_id: str) -> None:
        """End a session on the loop thread (waiting, prefilling or decoding; a driver's, or one whose step
        failed), its owner not told: its blocks go back to the pool now. No-op for an unknown one."""
        with self._cond:
            self._sessions.discard(session_id)
            self._waiting = deque(o for o in self._waiting if o.session_id != session_id)
            self._prefilling.pop(session_id, None)
            self._forget(session_id)
            self.verifier.release(session_id)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread at the start of its next round (e.g. a driver's cancel)."""
        with self._cond:
            self._check_open()
            self._soon.append(fn)
            self._cond.notify()

    # ----------------------------------------------------------------- state
    @property
    def alive(self) -> bool:
        """Whether the loop's thread still runs (it ends at ``close``)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop: calls still queued fail with RuntimeError, the driver's requests end with it."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preempted(self) -> int:
        """Sessions holding no KV blocks until they resume."""
        return len(self._paused)

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

    def _enqueue(self, opening: _Opening) -> None:
        """Queue a new session, or raise why it cannot wait (see ``open``)."""
        # fixed configuration, no lock needed: a request past the context served (what one request alone can hold
        # in the pool) is refused here, so every admitted one can finish
        self.verifier.check_request(opening.prompt, opening.sampling)
        need = opening.blocks = self.verifier.admission_blocks(len(opening.prompt))
        with self._cond:
            self._check_open()
            if opening.session_id in self._sessions:
                raise ValueError(f"session {opening.session_id!r} already exists")
            if self._queue_full(need):
                raise CapacityError(f"the verifier is full: {len(self._waiting)} requests already wait for KV blocks")
            self._sessions.add(opening.session_id)
            self._waiting.append(opening)
            self._cond.notify()

    def _queue_full(self, need: int) -> bool:
        """Under the lock: whether a session needing ``need`` blocks would wait for blocks behind ``max_waiting``
        others that do. Queued sessions that the pool can hold now are not waiting: the loop admits them at its
        next round."""
        free = self.verifier.allocator.num_free - self.verifier.watermark_blocks
        free -= sum(self.verifier.resume_blocks(sid) for sid in self._paused)  # they come first
        blocked = 0
        for opening in self._waiting:
            if blocked or opening.blocks > free:
                blocked += 1
            else:
                free -= opening.blocks
        return (blocked > 0 or need > free) and blocked >= self.max_waiting

    # ------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # a bug here must not leave every caller hanging
                log.exception("step loop round failed")
                if self.driver is not None:  # its requests may be half-stepped: end them
                    self.driver.stop(exc)

    def _driven(self) -> bool:
        return self.driver is not None and self.driver.pending()

    def _iterate(self) -> bool:
        """One round (see module doc); False once closed."""
        with self._cond:
            while not (self._closed or self._soon or self._releases or self._steppable_calls()
                       or any(sid not in self._paused for sid in self._prefilling) or self._resuming
                       or self._admissible() or self._driven()):
                self._cond.wait()
            self._gather_stragglers()
            if self._closed:
                closed = RuntimeError("the verifier is closed")
                self._fail_all(closed)
                if self.driver is not None:
                    self.driver.stop(closed)
                return False
            soon, self._soon = self._soon, []
            releases, self._releases = self._releases, []
            gone = []
            for session_id, _ in releases:
                self._sessions.discard(session_id)
                self._decoding.discard(session_id)
                exc = SessionReleasedError(f"session {session_id!r} was released")
                for opening in [o for o in self._waiting if o.session_id == session_id]:
                    self._waiting.remove(opening)
                    gone.append((opening.owner, exc))
                opening = self._prefilling.pop(session_id, None)
                if opening is not None:
                    gone.append((opening.owner, exc))
                for calls in (self._verifies, self._parked):
                    _, verify = calls.pop(session_id, (None, None))
                    if verify is not None:
                        self._no_wait.discard(verify)
                        _settle(verify, exc=exc)
                self._forget(session_id)
        for owner, exc in gone:
            owner.failed(exc)
        for fn in soon:
            fn()
        for session_id, future in releases:
            self.verifier.release(session_id)
            _settle(future)
        self._admit()
        self.step()
        return True

    def _gather_stragglers(self) -> None:
        """Under the lock, with Verify calls pending and nothing else to run: while only some called sessions
        have their Verify in, wait for the others up to min(max_wait, half a step) (see module doc)."""
        if not self._verifies or self._prefilling or self._releases or self._soon or self._driven():
            return
        deadline = time.monotonic() + min(self.max_wait, 0.5 * self._step_seconds)
        while (len(self._verifies) < len(self._decoding) and not self._closed
               and (remaining := deadline - time.monotonic()) > 0):
            self._cond.wait(remaining)

    def _steppable_calls(self) -> bool:
        """Under the lock: a caller's Verify (new, or parked while its session was preempted) can step, or one that
        does not wait for its preempted session has to be answered."""
        return any(sid not in self._paused and sid not in self._resuming or future in self._no_wait
                   for calls in (self._verifies, self._parked) for sid, (_, future) in calls.items())

    def _fits(self, blocks: int) -> bool:
        """Whether ``blocks`` are free with the watermark to spare (all of them when no session holds any)."""
        allocator = self.verifier.allocator
        spare = self.verifier.watermark_blocks if allocator.num_used else 0
        return blocks + spare <= allocator.num_free

    def _admissible(self) -> bool:
        """Under the lock: the first preempted session can resume, or (none preempted) the first waiting one can
        be admitted."""
        if self._paused:
            return self._fits(self.verifier.resume_blocks(min(self._paused, key=self._paused.get)))
        if not self._waiting:
            return False
        head = self._waiting[0]
        return self._fits(self.verifier.blocks_to_admit(head.prompt, head.features))

    def _admit(self) -> None:
        """Resume preempted sessions, oldest admission first, then admit waiting sessions in arrival order, while
        the pool has their blocks; then tell the owners of the admitted ones."""
        admitted, refused, resumed = [], [], []
        with self._cond:
            for session_id in sorted(self._paused, key=self._paused.get):
                if not self._fits(self.verifier.resume_blocks(session_id)):
                    break  # later ones and new admissions wait: the oldest work goes first
                self.verifier.resume(session_id)
                del self._paused[session_id]
                if session_id in self._prefilling:  # its first prefill goes on
                    continue
                if self.verifier.prefilling(session_id):  # decoding before: its KV is computed again, then it decodes
                    self._resuming.add(session_id)
                elif session_id in self._owners:  # all of it found in the prefix cache: it decodes on at once
                    resumed.append(self._owners[session_id])
            while self._waiting and not self._paused:
                head = self._waiting[0]
                if head.owner.abandoned():  # its caller went away while it waited
                    self._waiting.popleft()
                    self._sessions.discard(head.session_id)
                    continue
                if not self._fits(self.verifier.blocks_to_admit(head.prompt, head.features)):
                    break  # wait for blocks; later arrivals do not overtake it
                self._waiting.popleft()
                try:
                    self.verifier.admit(head.session_id, head.prompt, head.sampling, head.features,
                                        head.feedback_topk, head.lookahead)
                except Exception as exc:  # an invalid request
                    self._sessions.discard(head.session_id)
                    refused.append((head, exc))
                    continue
                self._prefilling[head.session_id] = head
                self._admitted += 1
                self._order[head.session_id] = self._admitted
                self._owners[head.session_id] = head.owner
                admitted.append(head)
        for owner in resumed:
            owner.resumed()
        for opening, exc in refused:
            opening.owner.failed(exc)
        for opening in admitted:
            if not opening.owner.admitted():  # gone meanwhile: its blocks go back
                self.drop(opening.session_id)

    def _pick_prefills(self, verify_tokens: int) -> list[str]:
        """Prefilling sessions whose next chunk fits the step's token budget (at least one if nothing else)."""
        budget = self.max_batch_tokens - verify_tokens
        chosen = []
        for session_id in [*self._resuming, *(s for s in self._prefilling if s not in self._paused)]:
            chunk = self.verifier.next_chunk(session_id)
            if (chosen or verify_tokens) and chunk > budget:
                break
            chosen.append(session_id)
            budget -= chunk
        return chosen

    # ------------------------------------------------------------- the step
    def step(self) -> None:
        """One step on the loop thread: the driver's trees and the callers' Verifys, prompt chunks in what the
        token budget leaves -> room in the KV pool for their rows (preemption) -> one forward with acceptance for
        all -> the driver commits, the futures resolve."""
        driven = self.driver.draft() if self.driver is not None else []
        with self._cond:
            # every session decoding now, in this step or not (for ``BatchStats.stepped_per_running``)
            decoding = len(self._decoding) + (self.driver.num_running if self.driver is not None else 0)
            calls = self._take_calls()
            verifies = driven + [(sid, tree) for sid, (tree, _) in calls.items()]
            rows = sum(tree.num_nodes + 1 for _, tree in verifies)
            prefills = self._pick_prefills(rows)
        if not verifies and not prefills:
            return
        out = self._make_room(verifies, prefills)  # the sessions preempted from this step
        stepping = [item for item in verifies if item[0] not in out]
        prefills = [sid for sid in prefills if sid not in out]
        chunk_tokens = sum(self.verifier.next_chunk(sid) for sid in prefills)
        started = time.perf_counter()
        try:
            in_flight = self.verifier.launch(prefills, stepping)
            if self.driver is not None and in_flight.rows:  # on a GPU the step is queued (on the CPU it ran): the
                self.driver.waiting()  # host only waits for its copy, so what runs meanwhile starts now
            firsts, results = self.verifier.finish(in_flight)
        except Exception as exc:  # a model failure: every session of the step gets it
            log.exception("batched step failed")
            firsts, results = exc, [exc] * len(stepping)
        else:
            seconds = time.perf_counter() - started
            self._step_seconds = 0.8 * self._step_seconds + 0.2 * seconds
            if out:
                rows = sum(tree.num_nodes + 1 for _, tree in stepping)
            self.stats.record(seconds, len(stepping), rows, len(prefills), chunk_tokens, len(firsts), decoding)
            if self.costs is not None and not prefills:  # (a prompt chunk's rows cost what the line does not model)
                self.costs.observe(len(stepping), rows, seconds)
        if out:  # the preempted sessions' results: their trees step again once they resume
            ran = iter(results)
            results = [_PREEMPTED if sid in out else next(ran) for sid, _ in verifies]
        if self.driver is not None:
            self.driver.commit(results[: len(driven)])
        for (session_id, (tree, future)), result in zip(calls.items(), results[len(driven) :], strict=True):
            if result is _PREEMPTED and future not in self._no_wait:
                with self._cond:
                    self._parked[session_id] = (tree, future)
            elif isinstance(result, Exception):
                _settle(future, exc=result)
            else:
                _settle(future, result)
        if self._no_wait:
            with self._cond:
                self._no_wait.difference_update(future for _, future in calls.values())
        self._prefilled(prefills, firsts)
        self._resumed(prefills)

    def _take_calls(self) -> dict[str, tuple[TokenTree, Future]]:
        """Under the lock: the callers' Verifys this step runs (claimed), parked ones first; those of preempted
        or resuming sessions stay queued."""
        waiting = self._paused.keys() | self._resuming
        calls = {sid: call for sid, call in self._parked.items() if sid not in waiting}
        for sid in calls:
            del self._parked[sid]
        for sid, (tree, future) in list(self._verifies.items()):
            if sid in waiting and future in self._no_wait:  # preempted: its caller sends it again later
                del self._verifies[sid]
                self._no_wait.discard(future)
                _settle(future, exc=_PREEMPTED)
            elif sid not in waiting:
                del self._verifies[sid]
                if _claim(future):
                    calls[sid] = (tree, future)
                else:  # its caller cancelled it
                    self._no_wait.discard(future)
        return calls

    def _make_room(self, verifies: Sequence[tuple[str, TokenTree]], prefills: Sequence[str]) -> set[str]:
        """Preempt the most recently admitted sessions until the pool has the blocks the step's rows write (a
        victim in the step leaves it); returns the victims of the step. A session alone always fits the pool
        (the context served is what it can hold), so the last one standing is never preempted."""
        need = self.verifier.step_blocks(verifies)
        short = sum(need.values()) - self.verifier.allocator.num_free
        if short <= 0:
            return set()
        victims, told = set(), []
        with self._cond:
            active = sorted((sid for sid in self._order if sid not in self._paused), key=self._order.get)
            while short > 0 and len(active) > 1:
                victim = active.pop()
                self.verifier.preempt(victim)  # (blocks it shares with others stay taken)
                need.pop(victim, None)
                short = sum(need.values()) - self.verifier.allocator.num_free
                self._paused[victim] = self._order[victim]
                self.stats.preemptions += 1
                if victim in self._resuming:  # preempted again before it was told it resumed
                    self._resuming.discard(victim)
                elif victim not in self._prefilling and victim in self._owners:  # decoding: its owner waits
                    told.append(self._owners[victim])
                victims.add(victim)
        log.debug("preempted %d sessions for a step's KV blocks", len(victims))
        for owner in told:
            owner.preempted()
        in_step = {sid for sid, _ in verifies} | set(prefills)
        return victims & in_step

    def _resumed(self, prefills: Sequence[str]) -> None:
        """Tell the owners of resumed sessions whose KV is computed again: they decode on."""
        done = [sid for sid in prefills if sid in self._resuming and not self.verifier.prefilling(sid)]
        if not done:
            return
        with self._cond:
            self._resuming.difference_update(done)
            owners = [self._owners[sid] for sid in done if sid in self._owners]
        for owner in owners:
            owner.resumed()

    def _forget(self, session_id: str) -> None:
        """Under the lock: the session's preemption state (it is released or dropped)."""
        self._order.pop(session_id, None)
        self._paused.pop(session_id, None)
        self._resuming.discard(session_id)
        self._owners.pop(session_id, None)

    def _prefilled(self, prefills: list[str], firsts: dict[str, int] | Exception) -> None:
        """Tell the owners of the step's prompt chunks whose prefill finished (or failed with the step)."""
        told = []
        with self._cond:
            for session_id in prefills:
                opening = self._prefilling.get(session_id)
                if opening is None:  # dropped by the driver during this step's commit
                    continue
                if isinstance(firsts, Exception):
                    self.drop(session_id)
                    told.append((opening, firsts))
                elif session_id in firsts:
                    del self._prefilling[session_id]
                    if not opening.driven:
                        self._decoding.add(session_id)
                    told.append((opening, PrefillResult(firsts[session_id], time.perf_counter() - opening.started,
                                                        self.verifier.take_prompt_features(session_id),
                                                        self.verifier.take_first_logprobs(session_id))))
        for opening, outcome in told:
            if isinstance(outcome, Exception):
                opening.owner.failed(outcome)
            else:
                opening.owner.prefilled(outcome)

    def _fail_all(self, exc: Exception) -> None:
        for opening in [*self._waiting, *self._prefilling.values()]:
            opening.owner.failed(exc)
        for _, future in [*self._verifies.values(), *self._parked.values()]:
            if not future.cancelled():
                _settle(future, exc=exc)
        for _, future in self._releases:
            _settle(future)
        self._waiting.clear()
        self._prefilling.clear()
        self._verifies.clear()
        self._parked.clear()
        self._no_wait.clear()
        self._releases.clear()
        self._soon.clear()
