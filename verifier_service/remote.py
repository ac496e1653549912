"""The Verifier interface over gRPC: what the orchestrator uses for a verifier replica.

``VerifierClient`` owns one channel to one replica and counts the sessions it
serves (for least-loaded placement); ``bind(deadline)`` returns the per-request
``RemoteVerifier`` whose calls carry the request's deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from specmesh import rpc
from specmesh.contract import (
    PREEMPTED_MESSAGE,
    ModelInfo,
    PrefillResult,
    SessionPreemptedError,
    TokenLogprobs,
    UnknownSessionError,
    VerifyResult,
)
from specmesh.feedback import TargetFeatures
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.wire import (
    VERIFIER_SERVICE,
    costs_from_proto,
    features_from_proto,
    feedback_from_proto,
    logprobs_from_proto,
    sampling_to_proto,
    tree_to_proto,
)
from verifier_service.costs import ReportedCosts

log = logging.getLogger("specmesh.remote_verifier")
RELEASE_TIMEOUT = 5.0  # Release runs even after the request's deadline passed


class VerifierClient(rpc.ReplicaChannel):
    def __init__(self, address: str, security: rpc.Security, call_timeout: float = 60.0) -> None:
        # Info and Release change nothing that a retry could duplicate
        super().__init__(address, security, verifier_pb2_grpc.VerifierStub,
                         [(VERIFIER_SERVICE, "Info"), (VERIFIER_SERVICE, "Release")])
        self.call_timeout = call_timeout
        self.info: ModelInfo | None = None
        self.costs: ReportedCosts | None = None  # the replica's measured forward costs (load-aware trees)

    def fetch_info(self, timeout: float) -> verifier_pb2.VerifierInfo:
        """Wait up to ``timeout`` s for the replica to come up; remembers its ModelInfo."""
        try:
            msg = self._stub.Info(verifier_pb2.InfoRequest(), timeout=timeout, metadata=self._metadata,
                                  wait_for_ready=True)
        except grpc.RpcError as exc:
            raise rpc.UpstreamError(f"verifier {self.address}", exc.code(), exc.details()) from None
        self.info = ModelInfo(msg.vocab_size, msg.max_positions, tuple(msg.eos_token_ids))
        self.note_costs(msg)
        return msg

    def note_costs(self, msg: verifier_pb2.VerifierInfo | verifier_pb2.VerifyBatchResponse) -> None:
        """The replica's forward costs as ``msg`` reports them (its refitted ``StepCosts``), into ``self.costs``: the
        object its callers' load-aware policies hold. Nothing when it reports none (not measured)."""
        if (costs := costs_from_proto(msg)) is None:
            return
        if self.costs is None:
            self.costs = ReportedCosts(costs)
        else:
            self.costs.update(costs)

    def bind(self, deadline: float | None) -> RemoteVerifier:
        if self.info is None:
            raise RuntimeError("fetch_info() first")
        return RemoteVerifier(self, deadline)


class RemoteVerifier:
    """Verifier protocol for one request; ``deadline``: absolute time.monotonic(), or None."""

    def __init__(self, client: VerifierClient, deadline: float | None) -> None:
        self.client = client
        self.info = client.info
        self.deadline = deadline
        self._open: set[str] = set()

    def _call(self, method, request, timeout: float | None = None, invalid: type[ValueError] = ValueError):
        c = self.client
        try:
            return method(request, timeout=timeout or rpc.call_timeout(self.deadline, c.call_timeout),
                          metadata=c._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc.code(), exc.details(), invalid) from None

    def _error(self, code: grpc.StatusCode, details: str, invalid: type[ValueError]) -> Exception:
        """The exception a failed call stands for (the same as the in-process verifier's where one exists)."""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid(details)
        if code == grpc.StatusCode.NOT_FOUND:
            return UnknownSessionError(details)
        return rpc.UpstreamError(f"verifier {self.client.address}", code, details)

    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                features: bool = False) -> PrefillResult:
        msg = self._call(self.client._stub.Prefill, self.prefill_request(session_id, prompt, sampling, features))
        return self.prefill_result(msg)

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        msg = self._call(self.client._stub.Verify, self.verify_request(session_id, tree), invalid=InvalidTreeError)
        return self.verify_result(msg)

    # the messages and answers as data, for a caller that makes the calls itself (the engine core's remote loop
    # sends a step's Verifys together on its own event loop: orchestrator/remote_loop.py)
    def prefill_request(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                        features: bool = False, lease_id: str = "") -> verifier_pb2.PrefillRequest:
        """The Prefill to send; the session counts as open from here on (a ``release`` after the call ended frees
        it, whatever its outcome). ``lease_id``: the caller's Lease, which the session ends with ("": none)."""
        self._open.add(session_id)
        self.client._add_sessions(1)
        return verifier_pb2.PrefillRequest(session_id=session_id, prompt=prompt, sampling=sampling_to_proto(sampling),
                                           return_features=features, lease_id=lease_id)

    def prefill_result(self, msg: verifier_pb2.PrefillResponse) -> PrefillResult:
        return PrefillResult(msg.first_token, msg.seconds, self._features(msg), self._logprobs(msg))

    @staticmethod
    def verify_request(session_id: str, tree: TokenTree,
                       trace_context: dict[str, str] | None = None) -> verifier_pb2.VerifyRequest:
        """``trace_context``: the request's step span (``tracing.carrier``), for an item of a VerifyBatch."""
        return verifier_pb2.VerifyRequest(session_id=session_id, tree=tree_to_proto(tree), trace_context=trace_context)

    def batch_results(self, msg: verifier_pb2.VerifyBatchResponse, num_items: int) -> list[VerifyResult | Exception]:
        """A VerifyBatch's answers in its items' order: each a result, or what that item's failure stands for. The
        replica's costs it reports go to the client (``note_costs``)."""
        self.client.note_costs(msg)
        if len(msg.items) != num_items:
            exc = rpc.UpstreamError(f"verifier {self.client.address}", grpc.StatusCode.INTERNAL,
                                    f"VerifyBatch answered {len(msg.items)} items of {num_items}")
            return [exc] * num_items
        return [self.verify_result(o.result) if o.code == 0
                else SessionPreemptedError(o.message) if o.message.startswith(PREEMPTED_MESSAGE)
                and o.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                else self._error(rpc.status_code(o.code), o.message, InvalidTreeError)
                for o in msg.items]

    def call_error(self, exc: grpc.RpcError, call: str) -> Exception:
        """What a failed ``call`` ("prefill", "verify") stands for (``_error``)."""
        return self._error(exc.code(), exc.details(), InvalidTreeError if call == "verify" else ValueError)

    def forget(self, session_id: str) -> bool:
        """Stop counting a session as open; True when it was (its Release is then the caller's to send)."""
        if session_id not in self._open:
            return False
        self._open.discard(session_id)
        self.client._add_sessions(-1)
        return True

    def verify_result(self, msg: verifier_pb2.VerifyResponse) -> VerifyResult:
        feedback = None
        if msg.HasField("feedback"):
            try:
                feedback = feedback_from_proto(msg.feedback)
            except ValueError as exc:  # feedback only helps drafting: drop it, keep the verification
                log.warning("verifier %s sent malformed feedback (%s); ignored", self.client.address, exc)
        return VerifyResult(tuple(msg.accepted_nodes), tuple(msg.tokens), msg.seconds, feedback,
                            max(1, msg.batch_sessions), self._features(msg), self._logprobs(msg))

    @staticmethod
    def _logprobs(msg) -> TokenLogprobs | None:
        """The token log-probabilities a Prefill / Verify answer carries; a malformed set is an error of the
        verifier (the request asked for them: nothing to fall back to)."""
        return logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None

    def _features(self, msg) -> TargetFeatures | None:
        """The target features a Prefill / Verify answer carries (float32 numpy rows), None when it has none or
        malformed ones (they only help drafting: dropped, the answer kept)."""
        if not msg.HasField("features"):
            return None
        try:
            return features_from_proto(msg.features)
        except ValueError as exc:
            log.warning("verifier %s sent malformed target features (%s); ignored", self.client.address, exc)
            return None

    def release(self, session_id: str) -> None:
        """Best effort: the verifier also frees idle sessions by itself."""
        if not self.forget(session_id):
            return
        try:
            self._call(self.client._stub.Release, verifier_pb2.ReleaseRequest(session_id=session_id),
                       timeout=RELEASE_TIMEOUT)
        except Exception as exc:  # the replica may be gone; its TTL reaper frees the cache
            log.warning("release of %s on %s failed: %s", session_id, self.client.address, exc)
