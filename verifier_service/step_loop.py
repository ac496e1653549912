"""The step loop of a verifier replica: one thread owns a LocalVerifier and runs one forward per step for every
session its callers hold.

Callers (the gRPC verifier service, ``specmesh verifier`` and its Ray replicas; the per-request engine in tests
and the ``threads`` benchmark) submit Prefill / Verify / Release on any thread and wait on a future; a Verify's
tree is the caller's. The sessions themselves, their admission, prompt chunks and preemption are the
``Scheduler``'s (scheduler.py), the same one the engine core steps its requests with (orchestrator/core.py,
whose own loop drafts the trees itself).

One round of the loop:

1. apply releases (their blocks go back to the pool first; a Prefill or Verify of a released session still
   waiting ends with ``SessionReleasedError``),
2. ``Scheduler.admit``: preempted sessions resume, waiting ones are admitted while the pool has their blocks
   (beyond ``max_waiting`` waiting, a new session gets ``CapacityError`` = RESOURCE_EXHAUSTED),
3. ``step``: every pending Verify (decode first: they are the latency), scheduled with prompt chunks
   (``Scheduler.schedule``: preemption when the pool lacks the step's blocks), one forward with acceptance for
   all, the futures resolve. A Verify whose session was preempted waits for it to resume (``parked``), or ends
   with ``SessionPreemptedError`` if its caller asked not to wait.

A caller's calls are sequential (it drafts between two Verifys) and arrive over the network at their own pace,
so without care they split into cohorts: those answered by step k come back while step k + 1 already runs the
others, and every step carries half of them. So when fewer Verifys are pending than sessions decode, the loop
waits for the rest, but never longer than half the last step's time (nor ``max_wait_ms``): a straggler costs
the others at most that, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from specmesh.contract import (
    CapacityError,
    PrefillResult,
    SessionReleasedError,
    VerifyCosts,
    VerifyResult,
)
from specmesh.host_runtime import close_at_exit
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.arguments import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAITING
from verifier_service.scheduler import PREEMPTED, Scheduler, Session, SessionStatus

if TYPE_CHECKING:  # the loop only calls it: importing it (torch) is its owner's business
    from specmesh.grammar import CompiledGrammar
    from verifier_service.verifier import LocalVerifier

DEFAULT_MAX_WAIT_MS = 5.0
log = logging.getLogger("specmesh.step_loop")


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


class StepLoop:
    """One thread stepping every caller's session of a LocalVerifier (see module doc). Also the Verifier protocol
    (``specmesh.contract``) for callers that block."""

    def __init__(self, verifier: LocalVerifier, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_waiting: int = DEFAULT_MAX_WAITING, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 costs: VerifyCosts | None = None, name: str = "step-loop") -> None:
        """``max_batch_tokens``, ``max_waiting``, ``costs``: the ``Scheduler``'s; ``max_wait_ms``: the longest wait
        for a straggling Verify."""
        self.scheduler = Scheduler(verifier, max_batch_tokens, max_waiting, costs)
        self.verifier = verifier
        self.info = verifier.info
        self.max_tree_nodes = verifier.max_tree_nodes
        self.costs, self.stats = self.scheduler.costs, self.scheduler.stats
        self.max_wait = max_wait_ms / 1e3
        self._cond = self.scheduler.cond  # one lock for the table and the calls
        self._verifies: dict[str, tuple[TokenTree, Future]] = {}
        self._parked: dict[str, tuple[TokenTree, Future]] = {}  # Verifys waiting for their session to resume
        self._releases: list[tuple[str, Future]] = []
        # the Verifys (their futures) that end instead of waiting if their session is preempted: per call, not per
        # session, as the call that ended so may be sent again before the step that ended it is over
        self._no_wait: set[Future] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        close_at_exit(self)  # joined before the interpreter finalizes (specmesh/host_runtime.py, "Exit")

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
                       features: bool = False, grammar: CompiledGrammar | None = None) -> Future:
        """``features``: report the session's target features (``LocalVerifier.admit``); ``grammar``: the
        request's grammar compiled (``LocalVerifier.compile_grammar``; None: compiled here, in the caller's thread,
        never on the loop's)."""
        future: Future = Future()
        try:
            grammar = grammar or self.compile_grammar(sampling)
            with self._cond:
                self._check_open()
                self.scheduler.add(Session(session_id, list(prompt), sampling, features, future=future,
                                           grammar=grammar))
        except (ValueError, CapacityError) as exc:
            future.set_exception(exc)
        return future

    def compile_grammar(self, sampling: SamplingParams) -> CompiledGrammar | None:
        """``LocalVerifier.compile_grammar``: any thread but the loop's."""
        return self.scheduler.verifier.compile_grammar(sampling)

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

    # ----------------------------------------------------------------- state
    @property
    def alive(self) -> bool:
        """Whether the loop's thread still runs (it ends at ``close``)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop: calls still queued fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def num_sessions(self) -> int:
        return self.scheduler.num_sessions

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_preempted(self) -> int:
        """Sessions holding no KV blocks until they resume."""
        return self.scheduler.num_preempted

    def has_session(self, session_id: str) -> bool:
        """Admitted or waiting, and not released."""
        return self.scheduler.has_session(session_id)

    def session_ids(self) -> list[str]:
        return self.scheduler.session_ids()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the verifier is closed")

    # ------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # a bug here must not stop the loop
                log.exception("step loop round failed")

    def _iterate(self) -> bool:
        """One round (see module doc); False once closed."""
        with self._cond:
            while not (self._closed or self._releases or self._steppable_calls() or self.scheduler.has_work()):
                self._cond.wait()
            self._gather_stragglers()
            if self._closed:
                self._fail_all(RuntimeError("the verifier is closed"))
                return False
            releases, self._releases = self._releases, []
        for session_id, future in releases:
            self._release(session_id)
            _settle(future)
        self._admit()
        self.step()
        return True

    def _end_session(self, session_id: str, exc: Exception) -> None:
        """Out of the scheduler (its blocks back); its Prefill, if still waiting or prefilling, ends with ``exc``."""
        session = self.scheduler.remove(session_id)
        if session is not None and session.future is not None and not session.future.done():
            _settle(session.future, exc=exc)

    def _release(self, session_id: str) -> None:
        exc = SessionReleasedError(f"session {session_id!r} was released")
        self._end_session(session_id, exc)
        with self._cond:
            for calls in (self._verifies, self._parked):
                _, verify = calls.pop(session_id, (None, None))
                if verify is not None:
                    self._no_wait.discard(verify)
                    _settle(verify, exc=exc)

    def _gather_stragglers(self) -> None:
        """Under the lock, with Verify calls pending and nothing else to run: while only some decoding sessions
        have their Verify in, wait for the others up to min(max_wait, half a step) (see module doc)."""
        if not self._verifies or self._releases or self.scheduler.has_work():
            return
        deadline = time.monotonic() + min(self.max_wait, 0.5 * self.scheduler.step_seconds)
        while (len(self._verifies) < self.scheduler.num_decoding and not self._closed
               and (remaining := deadline - time.monotonic()) > 0):
            self._cond.wait(remaining)

    def _waits(self, session_id: str) -> bool:
        """Whether a session's Verify cannot step now: it is preempted, or its KV is being computed again."""
        session = self.scheduler.get(session_id)
        return session is not None and session.status in (SessionStatus.PREEMPTED, SessionStatus.RESUMING)

    def _steppable_calls(self) -> bool:
        """Under the lock: a caller's Verify (new, or parked while its session was preempted) can step, or one that
        does not wait for its preempted session has to be answered."""
        return any(not self._waits(sid) or future in self._no_wait
                   for calls in (self._verifies, self._parked) for sid, (_, future) in calls.items())

    def _admit(self) -> None:
        """The scheduler's admissions, answered: a Prefill whose caller went away meanwhile gives its blocks back,
        a refused one gets why."""
        admissions = self.scheduler.admit()
        for session, exc in admissions.refused:
            if not session.future.cancelled():
                _settle(session.future, exc=exc)
        for session in admissions.admitted:
            if not _claim(session.future):  # gone meanwhile: its blocks go back
                self.scheduler.remove(session.session_id)

    # ------------------------------------------------------------- the step
    def step(self) -> None:
        """One step on the loop thread: the callers' Verifys and prompt chunks (``Scheduler.schedule``) -> one
        forward with acceptance for all -> the futures resolve."""
        with self._cond:
            calls = self._take_calls()
        batch = self.scheduler.schedule([(sid, tree) for sid, (tree, _) in calls.items()])
        if batch is None:
            return
        self.scheduler.launch(batch)
        out = self.scheduler.finish(batch)
        for (session_id, (tree, future)), result in zip(calls.items(), out.results, strict=True):
            if result is PREEMPTED and future not in self._no_wait:
                with self._cond:
                    self._parked[session_id] = (tree, future)
            elif isinstance(result, Exception):
                _settle(future, exc=result)
            else:
                _settle(future, result)
        if self._no_wait:
            with self._cond:
                self._no_wait.difference_update(future for _, future in calls.values())
        for session, outcome in out.prefilled:
            if isinstance(outcome, Exception):
                _settle(session.future, exc=outcome)
            else:
                _settle(session.future, outcome)

    def _take_calls(self) -> dict[str, tuple[TokenTree, Future]]:
        """Under the lock: the callers' Verifys this step runs (claimed), parked ones first; those of preempted
        or resuming sessions stay queued."""
        calls = {sid: call for sid, call in self._parked.items() if not self._waits(sid)}
        for sid in calls:
            del self._parked[sid]
        for sid, (tree, future) in list(self._verifies.items()):
            if self._waits(sid):
                if future in self._no_wait:  # preempted: its caller sends it again later
                    del self._verifies[sid]
                    self._no_wait.discard(future)
                    _settle(future, exc=PREEMPTED)
            else:
                del self._verifies[sid]
                if _claim(future):
                    calls[sid] = (tree, future)
                else:  # its caller cancelled it
                    self._no_wait.discard(future)
        return calls

    def _fail_all(self, exc: Exception) -> None:
        for sid in self.scheduler.session_ids():
            self._end_session(sid, exc)
        for _, future in [*self._verifies.values(), *self._parked.values()]:
            if not future.cancelled():
                _settle(future, exc=exc)
        for _, future in self._releases:
            _settle(future)
        self._verifies.clear()
        self._parked.clear()
        self._no_wait.clear()
        self._releases.clear()
