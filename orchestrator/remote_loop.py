"""The engine core's loop over a verifier replica: the requests of `specmesh serve --verifier ...` as data.

``RemoteStepLoop`` is the loop the engine core (orchestrator/core.py) drives when its verifier is a replica
behind gRPC instead of a ``LocalVerifier``; it offers the core what ``StepLoop`` does (``open``, ``drop``,
``call_soon``, ``close``) and steps the same way, one thread for every request on that replica:

    EngineCore.draft        every running request's tree (remote drafters asked together, see below)
    -> one Verify call per request, all sent before any answer is awaited
    -> EngineCore.commit    commit, stream, stop checks, as the loop's answers come back

The replica's own step loop puts the Verify calls that arrive together into one forward, so a core step is
one forward there. Prefills are not part of a step: each is sent when its request is opened, and its answer
(on a gRPC thread) is handed to the loop thread, which starts the request decoding at its next round. A
request dropped while its Prefill is in flight has the call cancelled and, once it has ended, its session
released: a Release must never overtake the Prefill it frees.

No thread per request: Verify and Prefill are gRPC futures; remote drafters' calls run on the drafting
pool shared by every request (``DrafterLink`` with ``background``), so a step waits for the slowest
drafter, not for their sum. The requests of one core move in step: a request whose tree is late holds the
step up to its drafter's deadline (``--draft-timeout-ms``), after which its link fails over, as the
per-request engine does.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from specmesh.contract import PrefillResult, VerifyResult
from specmesh.sampling import SamplingParams
from verifier_service.remote import RemoteVerifier, VerifierClient
from verifier_service.step_loop import BatchStats, SessionOwner, StepDriver

log = logging.getLogger("specmesh.remote_loop")


class RemoteStepLoop:
    """One thread stepping a driver's requests on one verifier replica (see module doc)."""

    def __init__(self, client: VerifierClient, driver: StepDriver, name: str = "remote-core") -> None:
        """``client``: a replica whose ``fetch_info`` succeeded; ``driver``: the engine core, whose
        ``traced(session_id, call)`` says which span each call is sent under (one trace per request)."""
        self.client = client
        self.verifier = RemoteVerifier(client, None)  # every call bounded by the client's call timeout
        self.info = client.info
        self.costs = client.costs
        self.driver = driver
        self.stats = BatchStats()
        self._cond = threading.Condition()  # reentrant use: the driver calls back in on the loop thread
        self._soon: list[Callable[[], None]] = []
        self._opens: list[tuple[str, list[int], SamplingParams, SessionOwner, bool]] = []  # to open next round
        self._prefilling: dict[str, tuple[grpc.Future, SessionOwner]] = {}  # Prefill in flight
        self._answered: list[tuple[str, grpc.Future]] = []  # Prefills answered, for the loop thread
        self._sessions: set[str] = set()  # opened and not dropped
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the driver's
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams, owner: SessionOwner,
             features: bool = False) -> None:
        """Queue a session (any thread): at the loop's next round ``owner.admitted()``, then its Prefill is
        sent. ValueError for an id in use, RuntimeError once closed; the replica checks the rest (its refusal
        reaches ``owner.failed``)."""
        with self._cond:
            self._check_open()
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} already exists")
            self._sessions.add(session_id)
            self._opens.append((session_id, list(prompt), sampling, owner, features))
            self._cond.notify()

    def drop(self, session_id: str) -> None:
        """End a session on the loop thread, its owner not told: a queued one is forgotten, a Prefill in flight
        is cancelled (and released once it ended), a decoding session released. No-op for an unknown one."""
        with self._cond:
            self._sessions.discard(session_id)
            self._opens = [o for o in self._opens if o[0] != session_id]
            prefilling = self._prefilling.pop(session_id, None)
        if prefilling is not None:
            call, _ = prefilling
            call.cancel()
            context = contextvars.copy_context()  # the Release joins the caller's trace from the gRPC thread too
            call.add_done_callback(lambda _: context.run(self.verifier.release, session_id, False))
        else:
            self.verifier.release(session_id, wait=False)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread at the start of its next round."""
        with self._cond:
            self._check_open()
            self._soon.append(fn)
            self._cond.notify()

    # ----------------------------------------------------------------- state
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop; the driver's requests end with RuntimeError (their sessions released)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_waiting(self) -> int:
        """Sessions not yet sent to the replica (it holds its own waiting queue)."""
        return len(self._opens)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine core is closed")

    # ------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # a bug here must not leave every request hanging
                log.exception("remote step loop round failed")
                self.driver.stop(exc)

    def _iterate(self) -> bool:
        """One round: queued functions, new sessions' Prefills sent, answered Prefills handed over, one step."""
        with self._cond:
            while not (self._closed or self._soon or self._opens or self._answered or self.driver.pending()):
                self._cond.wait()
            if self._closed:
                self._close_all()
                return False
            soon, self._soon = self._soon, []
            opens, self._opens = self._opens, []
            answered, self._answered = self._answered, []
        for fn in soon:
            fn()
        for session_id, prompt, sampling, owner, features in opens:
            self._send_prefill(session_id, prompt, sampling, owner, features)
        for session_id, call in answered:
            self._prefilled(session_id, call)
        if self.driver.pending():
            self.step()
        return True

    def _send_prefill(self, session_id: str, prompt: list[int], sampling: SamplingParams, owner: SessionOwner,
                      features: bool) -> None:
        if session_id not in self._sessions:  # dropped before it was sent
            return
        if not owner.admitted():  # it went away (its drafter failed to open, strictly): nothing was sent
            with self._cond:
                self._sessions.discard(session_id)
            return
        if session_id not in self._sessions:  # dropped while being admitted
            return
        with self.driver.traced(session_id, "prefill"):
            call = self.verifier.start_prefill(session_id, prompt, sampling, features)
        with self._cond:
            self._prefilling[session_id] = (call, owner)
        call.add_done_callback(lambda done: self._answer_in(session_id, done))

    def _answer_in(self, session_id: str, call: grpc.Future) -> None:
        """A Prefill's answer, on a gRPC thread: for the loop thread's next round."""
        with self._cond:
            if session_id in self._prefilling:
                self._answered.append((session_id, call))
                self._cond.notify()

    def _prefilled(self, session_id: str, call: grpc.Future) -> None:
        with self._cond:
            entry = self._prefilling.pop(session_id, None)
        if entry is None or entry[0] is not call:  # dropped meanwhile (drop released it)
            return
        owner = entry[1]
        try:
            result: PrefillResult = self.verifier.prefill_answer(call)
        except Exception as exc:  # refused (full, invalid), or the replica failed: the session is released
            with self._cond:
                self._sessions.discard(session_id)
            self.verifier.release(session_id, wait=False)
            owner.failed(exc)
            return
        owner.prefilled(result)

    def step(self) -> None:
        """The driver's trees, sent as one Verify each before any answer is read (the last one a blocking call,
        answered on this thread: one thread hop fewer); its commit in their order."""
        verifies = self.driver.draft()
        if not verifies:
            return
        started = time.perf_counter()
        calls: list[tuple[grpc.Future | None, Exception | None]] = []  # a gRPC future is an exception too
        for session_id, tree in verifies[:-1]:
            try:
                with self.driver.traced(session_id, "verify"):
                    calls.append((self.verifier.start_verify(session_id, tree), None))
            except Exception as exc:  # could not even be sent (a closed channel)
                calls.append((None, exc))
        session_id, tree = verifies[-1]
        try:
            with self.driver.traced(session_id, "verify"):
                last: VerifyResult | Exception = self.verifier.verify(session_id, tree)
        except Exception as exc:  # that request's alone
            last = exc
        results: list[VerifyResult | Exception] = []
        for call, unsent in calls:
            if unsent is not None:
                results.append(unsent)
                continue
            try:
                results.append(self.verifier.verify_answer(call))
            except Exception as exc:  # that request's alone
                results.append(exc)
        results.append(last)
        self.stats.record(time.perf_counter() - started, len(verifies),
                          sum(tree.num_nodes + 1 for _, tree in verifies), 0, 0, 0)
        self.driver.commit(results)

    def _close_all(self) -> None:
        """Closed: cancel the Prefills in flight; the driver ends its requests (each releasing its session)."""
        with self._cond:
            pending = list(self._prefilling.values())
            self._opens.clear()
            self._soon.clear()
            self._answered.clear()
        for call, _ in pending:
            call.cancel()
        self.driver.stop(RuntimeError("the engine core is closed"))


__all__ = ["RemoteStepLoop"]
