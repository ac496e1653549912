"""The engine core's loop over a verifier replica: the requests of `specmesh serve --verifier ...` as data.

``RemoteStepLoop`` is the loop the engine core (orchestrator/core.py) drives when its verifier is a replica
behind gRPC instead of a ``LocalVerifier``; it offers the core what ``StepLoop`` does (``open``, ``drop``,
``call_soon``, ``close``) and steps every request on that replica from one thread:

    EngineCore.begin_step   every request that can step, with its tree (remote drafters asked together)
    -> one VerifyBatch call with every tree: one forward on the replica (every request here drafts in the
       background: its pre-drafts were asked at begin_step, before the call went out)
    -> EngineCore.end_step  commit, stream, stop checks, when the answer lands

The thread runs an asyncio event loop of its own with a ``grpc.aio`` channel to the replica, so calls are
in flight with no thread per call or per request. A step is one VerifyBatch: its items join one forward on
the replica (``StepLoop.submit_verifies``), each answered as its own Verify would be, and each carries its
request's step span (``tracing.carrier``), so a request's trace still shows the replica's work for every one
of its steps. A replica without VerifyBatch (UNIMPLEMENTED) gets one Verify per request, all in flight at once;
until the first answer, one step at a time asks (``_verify_step``).

A step begins whenever requests can step: at the start, when a step's answer lands (its requests commit and
can step again), and when a late remote tree lands. The core never waits for a remote drafter (``core.late``):
a request whose tree is not back sits out, the others step without it, and it steps (in a step of its own
or with others that are ready then) once its tree lands; so several steps, each of other requests, may be
out at once, and the replica's step loop batches what arrives together. A drafter past its deadline
(``--draft-timeout-ms``) is failed over, as in the per-request engine.

The loop holds a ``Lease`` stream to the replica for as long as it runs and names it in every Prefill: when
this process dies (kill -9 included) its connection closes, the stream ends, and the replica frees the lease's
sessions within seconds (verifier_service/leases.py) instead of at its --session-ttl.

Prefills are not part of a step: each is a task started as soon as its request is opened, and its answer is
handed to the driver as it lands. A request dropped while its Prefill is in flight has the call cancelled and
its session released once it has ended: a Release must never overtake the Prefill it frees.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc

from specmesh import tracing
from specmesh.contract import PrefillResult, VerifyResult
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.remote import RELEASE_TIMEOUT, RemoteVerifier, VerifierClient
from verifier_service.scheduler import BatchStats

log = logging.getLogger("specmesh.remote_loop")
LEASE_RETRY = 0.5  # seconds between two attempts to attach the lease (the replica is restarting, or away)


class SessionOwner(Protocol):
    """Who hears how a session's admission and prefill went (the engine core's request). Called on the loop's
    thread."""

    def admitted(self) -> bool:
        """Its Prefill is about to be sent; False: it went away (nothing is sent)."""

    def prefilled(self, result: PrefillResult) -> None:
        """The prefill finished: the first token (and the prompt's features, when asked)."""

    def failed(self, exc: BaseException) -> None:
        """It never got (or lost) its session: refused, the call failed, closed."""


class RemoteDriver(Protocol):
    """The requests a remote loop steps (the engine core): steps that may overlap, several out at once."""

    def pending(self) -> bool:
        """Whether it has decoding requests to step now (it must neither lock nor block)."""

    @property
    def num_running(self) -> int:
        """Its decoding requests (preempted ones and any sitting a step out included) (``BatchStats.decoding``)."""

    def stop(self, exc: BaseException) -> None:
        """End every request it holds with ``exc`` (the loop closes, or a step failed on a bug)."""

    def begin_step(self, launch: bool = True):
        """The requests that can step now with their trees (``.verifies``), marked as in a step; None if none.
        ``launch`` False: what it drafts ahead meanwhile waits for ``launch`` (else ``end_step`` starts it)."""

    def launch(self, step) -> None:
        """Start drafting ahead for ``step`` (once the step's call is built: the loop only waits from there)."""

    def end_step(self, step, results: Sequence[VerifyResult | Exception]) -> None:
        """A step's answers landed: commit them (its requests can step again)."""

    def traced(self, session_id: str, call: str):
        """The context manager making current the span a call for that request belongs under."""


class RemoteStepLoop:
    """One thread (an asyncio loop) stepping a driver's requests on one verifier replica (see module doc)."""

    def __init__(self, client: VerifierClient, driver: RemoteDriver, name: str = "remote-core") -> None:
        """``client``: a replica whose ``fetch_info`` succeeded; ``driver``: the engine core, whose
        ``traced(session_id, call)`` says which span each call is sent under (one trace per request)."""
        self.client = client
        self.verifier = RemoteVerifier(client, None)  # messages, answers, errors; every call bounded by call_timeout
        self.driver = driver
        self.lease_id = uuid.uuid4().hex  # this loop's Lease: its sessions on the replica end with this process
        self.stats = BatchStats()
        self._lock = threading.Lock()  # what other threads hand in: functions to run, sessions to open, close
        self._soon: list[Callable[[], None]] = []
        self._opens: list[tuple[str, list[int], SamplingParams, SessionOwner, bool]] = []
        self._closed = False
        self._sessions: set[str] = set()  # opened and not dropped
        # the loop thread's own
        self._prefilling: dict[str, tuple[asyncio.Task, SessionOwner]] = {}  # Prefill in flight
        self._releases: set[asyncio.Task] = set()
        self._stepping: set[asyncio.Task] = set()  # steps out (each of other requests)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stub: verifier_pb2_grpc.VerifierStub | None = None
        self._batch: bool | None = None  # whether the replica answers VerifyBatch; None: not known yet
        self._asking: asyncio.Event | None = None  # set when the step asking it (the first) has its answer
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    # ------------------------------------------------------------ the driver's
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams, owner: SessionOwner,
             features: bool = False, feedback_topk: int | None = None, lookahead=None) -> None:
        """Queue a session (any thread): at the loop's next round ``owner.admitted()``, then its Prefill is
        sent. ValueError for an id in use, RuntimeError once closed; the replica checks the rest (its refusal
        reaches ``owner.failed``). ``feedback_topk`` and ``lookahead`` are the replica's own flags (``specmesh
        verifier --feedback-topk / --lookahead``), not the request's: what is asked here is not sent."""
        with self._lock:
            self._check_open()
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} already exists")
            self._sessions.add(session_id)
            self._opens.append((session_id, list(prompt), sampling, owner, features))
        self._notify(self._send_prefills)  # at once, even while a step's calls are out: its first token is latency

    def drop(self, session_id: str) -> None:
        """End a session on the loop thread, its owner not told: a queued one is forgotten, a Prefill in flight
        is cancelled (and released once it ended), a decoding session released. No-op for an unknown one. The
        Release joins the trace current here."""
        with self._lock:
            self._sessions.discard(session_id)
            self._opens = [o for o in self._opens if o[0] != session_id]
        entry = self._prefilling.pop(session_id, None)
        prefill = None
        if entry is not None:
            prefill = entry[0]
            prefill.cancel()
        self._release_soon(session_id, prefill)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread at the start of its next round."""
        with self._lock:
            self._check_open()
            self._soon.append(fn)
        self._notify()

    # ----------------------------------------------------------------- state
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop; the driver's requests end with RuntimeError (their sessions released)."""
        with self._lock:
            self._closed = True
        self._notify()
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

    def _notify(self, fn: Callable[[], None] | None = None) -> None:
        """Wake the loop (from any thread), or have it run ``fn`` as soon as it is free to."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn or self._wake.set)
            except RuntimeError:  # the loop has closed: nothing left to wake
                pass

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread after ``delay`` seconds, then look for requests that can step."""
        def run() -> None:
            fn()
            self._wake.set()

        self._notify(lambda: self._loop.call_later(delay, run))

    # ------------------------------------------------------------- the loop
    def _run(self, started: threading.Event) -> None:
        asyncio.run(self._main(started))

    async def _main(self, started: threading.Event) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        channel = self.client.aio_channel()
        self._stub = verifier_pb2_grpc.VerifierStub(channel)
        lease = asyncio.ensure_future(self._hold_lease())  # before any Prefill names it
        started.set()
        try:
            while True:
                try:
                    if not await self._round():
                        break
                except Exception as exc:  # a bug here must not leave every request hanging
                    log.exception("remote step loop round failed")
                    self.driver.stop(exc)
            if self._releases:  # the sessions just ended, released before the channel goes
                await asyncio.wait(set(self._releases), timeout=RELEASE_TIMEOUT)
        finally:
            lease.cancel()
            await channel.close()

    async def _hold_lease(self) -> None:
        """Keep the Lease stream open while the loop runs: attached again whenever it ends (the replica restarted
        or drains); a replica without Lease (UNIMPLEMENTED) is not asked again."""
        request = verifier_pb2.LeaseRequest(lease_id=self.lease_id)
        while True:
            try:
                async for _ in self._stub.Lease(request, metadata=self.client._metadata):
                    pass
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("verifier %s has no Lease: its sessions of a dead serve end at its --session-ttl",
                             self.client.address)
                    return
                log.debug("lease on %s ended: %s", self.client.address, exc.code().name)
            await asyncio.sleep(LEASE_RETRY)

    def _idle(self) -> bool:
        with self._lock:
            return not (self._closed or self._soon or self._opens or self.driver.pending())

    async def _round(self) -> bool:
        """One round: queued functions, new sessions' Prefills sent, one step."""
        while self._idle():
            self._wake.clear()
            if self._idle():
                await self._wake.wait()
        with self._lock:
            closed = self._closed
            soon, self._soon = self._soon, []
        if closed:
            self._close_all()
            return False
        for fn in soon:
            fn()
        self._send_prefills()
        step = self.driver.begin_step(launch=False)  # its drafting ahead starts once the call is built
        if step is not None:  # its answer is committed as it lands; meanwhile other requests may step
            # (those in another step or waiting for a late tree count as decoding but not in this one)
            task = self._loop.create_task(self._step(step, self.driver.num_running))
            self._stepping.add(task)
            task.add_done_callback(self._stepping.discard)
        return True

    # ------------------------------------------------------------- prefills
    def _send_prefills(self) -> None:
        """Send the Prefill of every session opened since (on the loop thread, between or during steps)."""
        with self._lock:
            opens, self._opens = self._opens, []
        for session_id, prompt, sampling, owner, features in opens:
            self._send_prefill(session_id, prompt, sampling, owner, features)

    def _send_prefill(self, session_id: str, prompt: list[int], sampling: SamplingParams, owner: SessionOwner,
                      features: bool) -> None:
        if session_id not in self._sessions:  # dropped before it was sent
            return
        if not owner.admitted():  # it went away (its drafter failed to open, strictly): nothing was sent
            with self._lock:
                self._sessions.discard(session_id)
            return
        if session_id not in self._sessions:  # dropped while being admitted
            return
        request = self.verifier.prefill_request(session_id, prompt, sampling, features, self.lease_id)
        with self.driver.traced(session_id, "prefill"):  # the task's context: the call's span joins the trace
            task = self._loop.create_task(self._call(self._stub.Prefill, request))
        self._prefilling[session_id] = (task, owner)
        task.add_done_callback(lambda done: self._prefilled(session_id, done))

    def _prefilled(self, session_id: str, task: asyncio.Task) -> None:
        """A Prefill's answer, handed to its owner as it lands (a step's calls may be out: a request that starts
        decoding now is drafted from the next step on)."""
        entry = self._prefilling.pop(session_id, None)
        if entry is None or entry[0] is not task:  # dropped meanwhile (drop releases it)
            return
        owner = entry[1]
        try:
            outcome = task.result()
            if isinstance(outcome, grpc.RpcError):  # refused (full, invalid), or the replica failed
                raise self.verifier.call_error(outcome, "prefill")
            result = self.verifier.prefill_result(outcome)
        except Exception as exc:  # the session is released; its owner hears why
            with self._lock:
                self._sessions.discard(session_id)
            self._release_soon(session_id, None)
            owner.failed(exc)
            return
        try:
            owner.prefilled(result)
        except Exception as exc:  # a bug there must not leave the request hanging
            log.exception("starting %s after its prefill failed", session_id)
            owner.failed(exc)
        self._wake.set()  # it decodes from the next step on: the loop may be idle

    # ------------------------------------------------------------- the step
    async def _step(self, step, num_decoding: int) -> None:
        """One step's trees in one VerifyBatch (one Verify each to a replica without it); the driver commits them
        when the answers land, and the loop looks for requests that can step again. ``num_decoding``: the driver's
        requests decoding when it began (``BatchStats.record``)."""
        verifies = step.verifies
        started = time.perf_counter()
        try:
            results = await self._verify_step(verifies, lambda: self.driver.launch(step))
        except asyncio.CancelledError:  # the loop is closing: the driver ends every request
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here fails this step's requests, not the loop
            log.exception("a remote step failed")
            results = [exc] * len(verifies)
        self.stats.record(time.perf_counter() - started, len(verifies),
                          sum(tree.num_nodes + 1 for _, tree in verifies), 0, 0, 0, num_decoding)
        try:
            self.driver.end_step(step, results)
        except Exception as exc:  # a bug must not leave the step's requests hanging
            log.exception("committing a remote step failed")
            self.driver.stop(exc)
        self._wake.set()

    async def _verify_step(self, verifies: list[tuple[str, TokenTree]],
                           built: Callable[[], None]) -> list[VerifyResult | Exception]:
        """A VerifyBatch, or one Verify each to a replica without it; ``built`` is called once the calls are built,
        before they are awaited. Until the replica has answered one VerifyBatch it is asked by one step at a time
        (steps of other requests sent meanwhile wait for that answer), so an older replica sees one VerifyBatch,
        not one per step in flight."""
        while self._batch is None and self._asking is not None:
            await self._asking.wait()
        if self._batch is not None:
            return await (self._verify_batch(verifies, built) if self._batch else self._verify_each(verifies, built))
        asking = self._asking = asyncio.Event()
        try:
            return await self._verify_batch(verifies, built)
        finally:  # answered (or failed without an answer: the next step asks again)
            self._asking = None
            asking.set()

    async def _verify_batch(self, verifies: list[tuple[str, TokenTree]],
                            built: Callable[[], None]) -> list[VerifyResult | Exception]:
        """The step's trees in one call; every item carries its request's step span (its trace)."""
        items = []
        for session_id, tree in verifies:
            with self.driver.traced(session_id, "verify"):
                items.append(self.verifier.verify_request(session_id, tree, tracing.carrier()))
        request = verifier_pb2.VerifyBatchRequest(items=items)
        built()
        outcome = await self._call(self._stub.VerifyBatch, request)
        if isinstance(outcome, grpc.RpcError):
            if outcome.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older replica: one Verify each from now on
                log.info("verifier %s has no VerifyBatch: sending one Verify per request", self.client.address)
                self._batch = False
                return await self._verify_each(verifies, built)
            return [self.verifier.call_error(outcome, "verify")] * len(verifies)
        self._batch = True
        return self.verifier.batch_results(outcome, len(verifies))

    async def _verify_each(self, verifies: list[tuple[str, TokenTree]],
                           built: Callable[[], None]) -> list[VerifyResult | Exception]:
        """The step's trees one Verify each, all in flight at once (a replica without VerifyBatch)."""
        calls = [self._verify(session_id, tree) for session_id, tree in verifies]
        built()  # (each builds its request as it starts: a share of the host work left beside the drafting)
        return await asyncio.gather(*calls)

    async def _verify(self, session_id: str, tree: TokenTree) -> VerifyResult | Exception:
        """One request's Verify, sent under its step's span; its result or what its failure stands for."""
        try:
            request = self.verifier.verify_request(session_id, tree)
            with self.driver.traced(session_id, "verify"):
                outcome = await self._call(self._stub.Verify, request)
        except Exception as exc:  # could not be sent: that request's alone
            return exc
        if isinstance(outcome, grpc.RpcError):
            return self.verifier.call_error(outcome, "verify")
        return self.verifier.verify_result(outcome)

    async def _call(self, method, request, timeout: float | None = None):
        """The answer of a unary call, or the grpc.RpcError it failed with (returned, not raised)."""
        try:
            return await method(request, timeout=timeout or self.client.call_timeout,
                                metadata=self.client._metadata)
        except grpc.RpcError as exc:
            return exc

    def _release_soon(self, session_id: str, prefill: asyncio.Task | None) -> None:
        """Release a session from a task of the loop's (in the current context: the Release joins its trace);
        the loop waits for these before its channel closes."""
        if self._loop is None or self._loop.is_closed():
            return
        task = self._loop.create_task(self._release(session_id, prefill))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, session_id: str, prefill: asyncio.Task | None) -> None:
        """Free a session on the replica once its Prefill (if one was in flight) has ended; best effort (the
        replica's idle reaper frees what this cannot)."""
        if prefill is not None:
            await asyncio.wait([prefill])
        if not self.verifier.forget(session_id):
            return
        outcome = await self._call(self._stub.Release, verifier_pb2.ReleaseRequest(session_id=session_id),
                                   RELEASE_TIMEOUT)
        if isinstance(outcome, grpc.RpcError):
            log.warning("release of %s on %s failed: %s", session_id, self.client.address, outcome.code().name)

    def _close_all(self) -> None:
        """Closed: the Prefills in flight are cancelled (drop), the driver ends its requests (each released)."""
        for task in self._stepping:  # their requests end now
            task.cancel()
        self.driver.stop(RuntimeError("the engine core is closed"))
        for session_id in list(self._prefilling):
            self.drop(session_id)


__all__ = ["RemoteStepLoop"]
