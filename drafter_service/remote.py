"""The Drafter interface over gRPC: one bidirectional stream per session.

Every session's stream is a ``grpc.aio`` call run by a task on the process's shared
background loop (``rpc.background_loop``: one thread for all sessions, not one per
session): requests go out through an asyncio queue; each Propose's answer resolves its
Future (``propose_async``), or a loop timer fails it with ``DraftTimeout`` at the step's
deadline, so no caller's thread waits unless it asks to (``propose``). Steps are
numbered: an answer that arrives after its step was given up on is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

import grpc

from specmesh import rpc
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc
from specmesh.wire import (
    DRAFTER_SERVICE,
    budget_to_proto,
    features_to_proto,
    feedback_to_proto,
    newest_features,
    sampling_to_proto,
    tree_from_proto,
)

log = logging.getLogger("specmesh.remote_drafter")
_END = object()


class DraftTimeout(TimeoutError):
    pass


class DrafterClient(rpc.ReplicaChannel):
    """One channel to one drafter replica, with the number of sessions it serves."""

    def __init__(self, address: str, security: rpc.Security, default_wait: float = 5.0) -> None:
        super().__init__(address, security, drafter_pb2_grpc.DrafterStub, [(DRAFTER_SERVICE, "Info")])
        self.default_wait = default_wait  # per proposal, when the budget carries no deadline
        self.feature_proposers: frozenset[str] | None = None  # from its Info (None = not heard yet)
        # the grpc.aio channel the sessions' streams use, made on the background loop on first use
        self._aio: tuple[asyncio.AbstractEventLoop, grpc.aio.Channel, drafter_pb2_grpc.DrafterStub] | None = None

    def info(self, timeout: float, wait_for_ready: bool = False) -> drafter_pb2.DrafterInfo:
        msg = self._stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout, metadata=self._metadata,
                              wait_for_ready=wait_for_ready)
        self.feature_proposers = frozenset(msg.feature_proposers)
        return msg

    def wants_features(self, proposer: str | None, timeout: float = 1.0) -> bool:
        """Whether this replica's ``proposer`` reads the target's features (``DrafterInfo.feature_proposers``,
        asked once, on first need; an unreachable replica: no, and asked again next time). None: no."""
        if self.feature_proposers is None:
            try:
                self.info(timeout)
            except grpc.RpcError:
                return False
        return proposer is not None and proposer in self.feature_proposers

    def drafter(self, proposer: str | None = None, deadline: float | None = None) -> RemoteDrafter:
        return RemoteDrafter(self, proposer, deadline)

    def session_stub(self) -> drafter_pb2_grpc.DrafterStub:
        """The stub of this replica's ``grpc.aio`` channel (call on the background loop, which owns it)."""
        loop = asyncio.get_running_loop()
        if self._aio is None or self._aio[0] is not loop:
            channel = self.aio_channel()
            self._aio = (loop, channel, drafter_pb2_grpc.DrafterStub(channel))
        return self._aio[2]

    def close(self) -> None:
        super().close()
        if self._aio is not None:
            loop, channel, _ = self._aio
            self._aio = None
            try:
                asyncio.run_coroutine_threadsafe(channel.close(), loop)
            except RuntimeError:  # the loop has closed (interpreter exit): so has the channel
                pass


class RemoteDrafter:
    """Drafter protocol, and ``AsyncDrafter``: no call blocks its caller except the synchronous ``propose``
    (what a sequential loop asks); ``proposer`` None = the replica's default; ``deadline`` bounds the whole
    stream."""

    def __init__(self, client: DrafterClient, proposer: str | None, deadline: float | None) -> None:
        self.client = client
        self.proposer = proposer
        self.deadline = deadline
        self._streams: dict[str, _DraftStream] = {}

    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
             prompt_len: int | None = None) -> None:
        opening = drafter_pb2.OpenSession(
            session_id=session_id, prompt=prompt, sampling=sampling_to_proto(sampling), proposer=self.proposer or ""
        )
        if prompt_len is not None:
            opening.prompt_len = prompt_len
        timeout = None if self.deadline is None else max(0.001, self.deadline - time.monotonic())
        self._streams[session_id] = _DraftStream(self.client, opening, timeout)
        self.client._add_sessions(1)

    def propose_async(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                      feedback: DraftFeedback | None = None) -> Future:
        """Future of the tree; it fails with the stream's error, or with DraftTimeout at the budget's deadline
        (else ``client.default_wait`` from now)."""
        deadline = budget.deadline if budget.deadline is not None else time.monotonic() + self.client.default_wait
        return self._streams[session_id].ask(new_tokens, budget, deadline, rollback, feedback)

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        return self.propose_async(session_id, new_tokens, budget, rollback, feedback).result()

    def close(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            self.client._add_sessions(-1)
            stream.close()


class _DraftStream:
    """One session's stream. The call, its answers and its timers live on the background loop; ``ask`` and
    ``close`` hand work to it from the caller's thread (one caller at a time: a link's calls are serial)."""

    def __init__(self, client: DrafterClient, opening: drafter_pb2.OpenSession, timeout: float | None) -> None:
        self.address = client.address
        self._loop = rpc.background_loop()
        self._step = 0  # the caller's
        # the loop's
        self._outbox: asyncio.Queue = asyncio.Queue()  # requests to send, then _END
        self._waiting: dict[int, tuple[Future, float]] = {}  # step -> (its tree's future, its deadline)
        self._error: Exception | None = None  # why the stream ended: every later ask fails with it
        self._task: asyncio.Task | None = None
        self._on_loop(self._outbox.put_nowait, drafter_pb2.DraftRequest(open=opening))
        # the call starts in a copy of the opener's context: with tracing on it joins the opener's trace
        self._loop.call_soon_threadsafe(contextvars.copy_context().run, self._start, client, timeout)

    def _on_loop(self, fn, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)  # in order: the loop runs these FIFO

    # ------------------------------------------------------------ the caller's side
    def ask(self, new_tokens: Sequence[int], budget: Budget, deadline: float, rollback: int,
            feedback: DraftFeedback | None = None) -> Future:
        self._step += 1
        timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        propose = drafter_pb2.Propose(step=self._step, new_tokens=new_tokens, budget=budget_to_proto(budget, timeout_ms),
                                      rollback=rollback)
        if feedback is not None:
            propose.committed_len = feedback.committed_len
            propose.feedback.extend(feedback_to_proto(v) for v in feedback.verified)
            # float32 numpy rows (a remote verifier's), bf16 again on the way out: exact, they were bf16
            propose.features.extend(features_to_proto(f) for f in newest_features(feedback.features))
        future: Future = Future()
        self._on_loop(self._send, self._step, drafter_pb2.DraftRequest(propose=propose), future, deadline)
        return future

    def close(self) -> None:
        """Half-close the stream; it is cancelled once the proposals still out are answered or past their
        deadlines (the context sync before a close gets its answer), at once if none is."""
        try:
            self._on_loop(self._close)
        except RuntimeError:  # the loop has closed (interpreter exit): so has the stream
            pass

    # ------------------------------------------------------------ the loop's side
    def _start(self, client: DrafterClient, timeout: float | None) -> None:
        self._task = self._loop.create_task(self._run(client, timeout))

    def _send(self, step: int, request: drafter_pb2.DraftRequest, future: Future, deadline: float) -> None:
        if self._error is not None:
            future.set_exception(self._error)
            return
        self._waiting[step] = (future, deadline)
        self._outbox.put_nowait(request)
        self._loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, step)

    def _expire(self, step: int) -> None:
        waiting = self._waiting.pop(step, None)
        if waiting is not None:  # answers that come after this are dropped
            waiting[0].set_exception(DraftTimeout(f"drafter {self.address} sent no tree within the step's deadline"))

    def _close(self) -> None:
        self._outbox.put_nowait(_END)
        grace = max((deadline for _, deadline in self._waiting.values()), default=0.0) - time.monotonic()
        if grace > 0:
            self._loop.call_later(grace, self._cancel)
        else:
            self._cancel()

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _requests(self):
        while (request := await self._outbox.get()) is not _END:
            yield request

    async def _run(self, client: DrafterClient, timeout: float | None) -> None:
        call = None
        try:
            call = client.session_stub().Session(self._requests(), timeout=timeout, metadata=client._metadata)
            async for response in call:
                waiting = self._waiting.pop(response.step, None)
                if waiting is not None:  # else an answer to a step given up on: dropped
                    try:
                        waiting[0].set_result(tree_from_proto(response.tree))
                    except Exception as exc:  # noqa: BLE001 - a malformed tree fails its proposal
                        waiting[0].set_exception(exc)
            error = rpc.UpstreamError(f"drafter {self.address}", grpc.StatusCode.UNAVAILABLE,
                                      "the drafter ended the session")
        except grpc.RpcError as exc:
            error = rpc.UpstreamError(f"drafter {self.address}", exc.code(), exc.details())
        except asyncio.CancelledError:  # closed
            error = rpc.UpstreamError(f"drafter {self.address}", grpc.StatusCode.CANCELLED, "the session was closed")
        except Exception as exc:  # noqa: BLE001 - a bug or an answer that does not parse: the session fails
            log.exception("drafter %s: the session's stream failed", self.address)
            error = rpc.UpstreamError(f"drafter {self.address}", grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        finally:
            if call is not None:
                call.cancel()
        self._error = error
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            future.set_exception(error)
