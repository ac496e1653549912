"""The Drafter interface over gRPC: one bidirectional stream per session.

Each session's stream has a reader thread that moves responses into a queue, so
``propose`` can wait for its answer with a deadline. Steps are numbered: an
answer that arrives after its step was given up on is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

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


class RemoteDrafter:
    """Drafter protocol; ``proposer`` None = the replica's default; ``deadline`` bounds the whole stream."""

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

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        deadline = budget.deadline if budget.deadline is not None else time.monotonic() + self.client.default_wait
        return self._streams[session_id].propose(new_tokens, budget, deadline, rollback, feedback)

    def close(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            self.client._add_sessions(-1)
            stream.close()


class _DraftStream:
    def __init__(self, client: DrafterClient, opening: drafter_pb2.OpenSession, timeout: float | None) -> None:
        self.address = client.address
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(drafter_pb2.DraftRequest(open=opening))
        self._call = client._stub.Session(iter(self._requests.get, _END), timeout=timeout, metadata=client._metadata)
        self._step = 0
        self._reader = threading.Thread(target=self._read, name=f"draft-stream-{opening.session_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
            self._responses.put(rpc.UpstreamError(f"drafter {self.address}", grpc.StatusCode.UNAVAILABLE,
                                                  "the drafter ended the session"))
        except grpc.RpcError as exc:
            self._responses.put(rpc.UpstreamError(f"drafter {self.address}", exc.code(), exc.details()))

    def propose(self, new_tokens: Sequence[int], budget: Budget, deadline: float, rollback: int,
                feedback: DraftFeedback | None = None) -> TokenTree:
        self._step += 1
        timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        propose = drafter_pb2.Propose(step=self._step, new_tokens=new_tokens, budget=budget_to_proto(budget, timeout_ms),
                                      rollback=rollback)
        if feedback is not None:
            propose.committed_len = feedback.committed_len
            propose.feedback.extend(feedback_to_proto(v) for v in feedback.verified)
            # float32 numpy rows (a remote verifier's), bf16 again on the way out: exact, they were bf16
            propose.features.extend(features_to_proto(f) for f in newest_features(feedback.features))
        self._requests.put(drafter_pb2.DraftRequest(propose=propose))
        while True:
            try:
                item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DraftTimeout(f"drafter {self.address} sent no tree within the step's deadline") from None
            if isinstance(item, Exception):
                self._responses.put(item)  # every later call fails the same way
                raise item
            if item.step == self._step:
                return tree_from_proto(item.tree)
            # an answer to a step given up on earlier: drop it

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()
