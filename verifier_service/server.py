"""`specmesh verifier`: the Verifier gRPC service, a thin shell over a StepLoop.

Model work runs on the step loop's thread: the Prefill and Verify calls of
all sessions pending at a step share one forward (continuous batching, see
``verifier_service/step_loop.py``), so the event loop stays free for health checks and
new calls. A Prefill the KV pool cannot hold waits in a bounded queue; beyond it the
call gets RESOURCE_EXHAUSTED. Sessions die with their caller: a caller holds a ``Lease``
stream open while it lives and names it in each Prefill, and a few seconds after the
stream ends (the orchestrator was killed, crashed or restarted: its connection closed)
the lease's sessions are released, which returns their KV blocks
(verifier_service/leases.py). Sessions of a caller without a lease are released after
``session_ttl`` seconds without a call, the backstop. A Release that overtakes the same session's Prefill
(or a Verify not yet stepped) frees it at once; that call answers ABORTED.

Sessions are keyed by the caller's identity and its session id (``session_key``); no
answer ever names that key, only the caller's own id (``_as_caller_sees``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from specmesh import metrics, models, rpc, serving, tracing
from specmesh.contract import (
    PREEMPTED_MESSAGE,
    CapacityError,
    SessionPreemptedError,
    SessionReleasedError,
    UnknownSessionError,
    VerifyResult,
    check_session_id,
)
from specmesh.feedback import TargetFeatures
from specmesh.grammar_limits import add_grammar_limit_arguments, grammar_limits
from specmesh.tree import MAX_TREE_NODES, InvalidTreeError, TokenTree
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.wire import (
    VERIFIER_SERVICE,
    costs_into_proto,
    features_to_proto,
    feedback_to_proto,
    logprobs_to_proto,
    newest_features,
    sampling_from_proto,
    tree_from_proto,
)
from verifier_service.arguments import add_batching_arguments, add_lookahead_argument
from verifier_service.leases import LEASE_SWEEP, Leases

if TYPE_CHECKING:
    from verifier_service.step_loop import StepLoop

log = logging.getLogger("specmesh.verifier")


def session_key(context: grpc.aio.ServicerContext, session_id: str) -> str:
    """The verifier's own name for a caller's session: the caller's identity (``rpc.caller_identity``: its
    token or client certificate), a newline, the session id. A session belongs to the identity that opened
    it: the same id from anyone else names another session (or none, NOT_FOUND), so one caller can neither
    reach another's session nor learn that an id is taken. Anonymous callers (no token, no client
    certificate) share one namespace."""
    return f"{rpc.caller_identity(context)}\n{session_id}"


def describe_key(key: str) -> str:
    identity, _, session_id = key.partition("\n")
    return f"{session_id!r} of {identity or 'an anonymous caller'}"


def _as_caller_sees(message: str, key: str) -> str:
    """A core error message with the session named by the caller's own id, never by the verifier's key (in any
    form: quoted, bare, or escaped inside other quotes)."""
    session_id = key.partition("\n")[2]
    message = message.replace(repr(key), repr(session_id))
    for form in (key, repr(key)[1:-1]):
        message = message.replace(form, session_id)
    return message


def check_lease_id(lease_id: str) -> None:
    """ValueError unless a lease id is as long as a session id may be."""
    try:
        check_session_id(lease_id)
    except ValueError as exc:
        raise ValueError(str(exc).replace("session_id", "lease_id")) from None


def _not_found(session_id: str) -> str:
    return f"no session {session_id!r} of this caller (never opened, released, or idle past --session-ttl)"


def _released(session_id: str, call: str) -> str:
    return f"session {session_id!r} was released before its {call} finished"


VERIFY_ITEM_SPAN = "verify"  # a VerifyBatch item's verification, a child of its request's step span


async def _outcome(wait) -> object:
    """A VerifyBatch item's result (``wait``: its step loop future), or the exception it failed with (returned,
    not raised)."""
    if isinstance(wait, Exception):
        return wait
    try:
        return await asyncio.wrap_future(wait)
    except Exception as exc:  # noqa: BLE001 - the item's own failure
        return exc


def verify_response(result: VerifyResult) -> verifier_pb2.VerifyResponse:
    response = verifier_pb2.VerifyResponse(accepted_nodes=result.accepted_nodes, tokens=result.tokens,
                                           seconds=result.seconds, batch_sessions=result.batch_sessions)
    if result.feedback is not None:
        response.feedback.CopyFrom(feedback_to_proto(result.feedback))
    if result.features is not None:
        response.features.CopyFrom(features_message(result.features))
    if result.logprobs is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(result.logprobs))
    return response


def _verify_attributes(span, tree: TokenTree, result: VerifyResult) -> None:
    """A verification's attributes on its span (a Verify's server span, a VerifyBatch item's span)."""
    if span.is_recording():
        span.set_attributes({"specmesh.verify.tree_nodes": tree.num_nodes, "specmesh.verify.tree_depth": tree.max_depth,
                             "specmesh.verify.accepted": result.num_accepted,
                             "specmesh.verify.batch_sessions": result.batch_sessions,
                             "specmesh.verify.forward_ms": result.seconds * 1e3})


def features_message(features: TargetFeatures) -> common_pb2.TargetFeatures:
    """A session's target features as bf16 on the wire; a prompt too large for one message keeps its newest rows
    (the drafter drafts on zeros for the rest: acceptance, never the output, suffers)."""
    rows = features.rows.float().cpu().numpy()  # deliberate host copy: the features leave the process
    kept = newest_features([TargetFeatures(features.start, rows)])
    return features_to_proto(kept[0] if kept else TargetFeatures(features.start, rows[:0]))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: StepLoop, model_name: str = "", session_ttl: float = 600.0) -> None:
        self.verifier = verifier
        self.model_name = model_name
        self.session_ttl = session_ttl
        self._last_call: dict[str, float] = {}
        self.leases = Leases()
        self._leases_ended = asyncio.Event()  # set by end_leases: every Lease stream returns
        self.draining = False  # set when this replica is being stopped: new sessions go elsewhere

    async def drain(self, timeout: float) -> bool:
        """Refuse new sessions (UNAVAILABLE: the orchestrator tries another replica), end the Lease streams and
        wait up to ``timeout`` seconds for the open sessions to end. True if none is left."""
        self.draining = True
        await self.end_leases()
        return await serving.wait_until_idle(lambda: self.verifier.num_sessions, timeout)

    async def end_leases(self, grace: float = 0.0) -> None:
        """The replica is stopping: every Lease stream ends now (a stream in flight would hold the server's stop
        for its whole grace) and no lease expires from here on (their callers live: their requests in flight
        finish, each Release frees its session). Also ``serve``'s drain hook (``grace`` unused)."""
        self.leases.frozen = True
        self._leases_ended.set()

    # ------------------------------------------------------------------- RPCs
    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this verifier replica is shutting down")
        key = session_key(context, request.session_id)
        try:
            check_session_id(request.session_id)
            if request.lease_id:
                check_lease_id(request.lease_id)
            sampling = sampling_from_proto(request.sampling)
            # the grammar compiled on a worker (cached by spec) before the loop sees the session; the event loop
            # serves the other calls meanwhile
            grammar = None if sampling.grammar is None else \
                await asyncio.to_thread(self.verifier.compile_grammar, sampling)
            future = self.verifier.submit_prefill(key, list(request.prompt), sampling, request.return_features,
                                                  grammar)
            result = await asyncio.wrap_future(future)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _as_caller_sees(str(exc), key))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except SessionReleasedError:  # the caller's own Release overtook it: the session is gone
            await context.abort(grpc.StatusCode.ABORTED, _released(request.session_id, "Prefill"))
        except asyncio.CancelledError:
            # the caller is gone (cancel, deadline) while the prefill waited or ran: nobody will Release it
            self.verifier.submit_release(key)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed step or a bug: answered without the internal key
            await context.abort(*self._unexpected("Prefill", key, exc))
        if self.verifier.has_session(key):  # not when a Release came in meanwhile (nothing would drop it)
            self._last_call[key] = time.monotonic()
            if request.lease_id:  # it ends with its caller's lease
                self.leases.add_session(session_key(context, request.lease_id), key, time.monotonic())
        span = tracing.current_span()  # the call's server span, with tracing on
        if span.is_recording():
            span.set_attributes({"specmesh.session.id": request.session_id,
                                 "specmesh.prefill.prompt_tokens": len(request.prompt),
                                 "specmesh.prefill.forward_ms": result.seconds * 1e3})
        response = verifier_pb2.PrefillResponse(first_token=result.first_token, seconds=result.seconds)
        if result.features is not None:
            response.features.CopyFrom(features_message(result.features))
        if result.logprobs is not None:
            response.logprobs.CopyFrom(logprobs_to_proto(result.logprobs))
        return response

    async def Verify(self, request, context):
        key = session_key(context, request.session_id)
        try:
            tree = tree_from_proto(request.tree)
            self._touch(key)
            result = await asyncio.wrap_future(self.verifier.submit_verify(key, tree))
        except Exception as exc:  # noqa: BLE001 - every failure is answered in the caller's terms
            await context.abort(*self._verify_failure(exc, request.session_id, key))
        _verify_attributes(tracing.current_span(), tree, result)  # the call's server span, with tracing on
        return verify_response(result)

    async def VerifyBatch(self, request, context):
        """Every item's Verify in one step (``StepLoop.submit_verifies``); each answered as its own call would be,
        its verification recorded in its request's trace (the item's ``trace_context``)."""
        arrived_ns = time.time_ns()
        keys = [session_key(context, item.session_id) for item in request.items]
        if len(set(keys)) < len(keys):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a VerifyBatch names a session twice")
        trees, submits = [], []
        for key, item in zip(keys, request.items, strict=True):
            try:
                trees.append(tree_from_proto(item.tree))
                submits.append((key, trees[-1]))
                self._touch(key)
            except Exception as exc:  # noqa: BLE001 - that item's alone
                trees.append(exc)
        try:
            # an item whose session the loop preempts answers at once (RESOURCE_EXHAUSTED) and is sent again: the
            # other items must not wait for it
            submitted = self.verifier.submit_verifies(submits, wait_if_preempted=False)
        except Exception as exc:  # noqa: BLE001 - closed: every item's answer
            submitted = [exc] * len(submits)
        futures = iter(submitted)
        waits = [tree if isinstance(tree, Exception) else next(futures) for tree in trees]
        results = await asyncio.gather(*(_outcome(w) for w in waits))
        response = verifier_pb2.VerifyBatchResponse()
        costs_into_proto(self.verifier.costs, response)  # the current fit: the callers' policies follow it
        for key, item, tree, result in zip(keys, request.items, trees, results, strict=True):
            outcome = response.items.add()
            span = tracing.remote_span(item.trace_context, VERIFY_ITEM_SPAN, arrived_ns,
                                       {"specmesh.session.id": item.session_id})
            if isinstance(result, Exception):
                code, outcome.message = self._verify_failure(result, item.session_id, key)
                outcome.code = code.value[0]
                tracing.record_error(span, result)
            else:
                outcome.result.CopyFrom(verify_response(result))
                _verify_attributes(span, tree, result)
            span.end()
        return response

    def _verify_failure(self, exc: Exception, session_id: str, key: str) -> tuple[grpc.StatusCode, str]:
        """The status a Verify that failed with ``exc`` answers, in the caller's terms."""
        if isinstance(exc, UnknownSessionError):
            return grpc.StatusCode.NOT_FOUND, _not_found(session_id)
        if isinstance(exc, SessionReleasedError):  # the caller's own Release overtook it
            return grpc.StatusCode.ABORTED, _released(session_id, "Verify")
        if isinstance(exc, SessionPreemptedError):  # a VerifyBatch item: send it again (RemoteStepLoop does)
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{PREEMPTED_MESSAGE}: session {session_id!r}"
        if isinstance(exc, (InvalidTreeError, ValueError)):
            return grpc.StatusCode.INVALID_ARGUMENT, _as_caller_sees(f"invalid tree: {exc}", key)
        return self._unexpected("Verify", key, exc)  # a failed step or a bug

    async def Release(self, request, context):
        key = session_key(context, request.session_id)
        if not self.verifier.has_session(key):
            await context.abort(grpc.StatusCode.NOT_FOUND, _not_found(request.session_id))
        self._last_call.pop(key, None)
        self.leases.drop_session(key)
        await asyncio.wrap_future(self.verifier.submit_release(key))
        self._last_call.pop(key, None)  # a Prefill that finished just before it may have stamped it meanwhile
        self.leases.drop_session(key)
        return verifier_pb2.ReleaseResponse()

    async def Lease(self, request, context):
        """Held open by a caller while it lives: one LeaseEvent once attached, then nothing until the replica
        drains (``end_leases``). When it ends otherwise (the caller's connection closed: the call is cancelled),
        the lease's sessions are released ``LEASE_GRACE`` seconds later unless the caller attaches again."""
        try:
            check_lease_id(request.lease_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._leases_ended.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this verifier replica is shutting down")
        lease = session_key(context, request.lease_id)
        self.leases.attach(lease, time.monotonic())
        try:
            yield verifier_pb2.LeaseEvent()
            await self._leases_ended.wait()
        finally:  # returned (draining) or cancelled (the caller is gone)
            self.leases.detach(lease, time.monotonic())

    async def Info(self, request, context):
        info = self.verifier.info
        allocator = self.verifier.verifier.allocator
        msg = verifier_pb2.VerifierInfo(
            vocab_size=info.vocab_size,
            max_positions=info.max_positions,
            eos_token_ids=info.eos_token_ids,
            max_tree_nodes=self.verifier.max_tree_nodes,
            num_sessions=self.verifier.num_sessions,
            model=self.model_name,
            kv_blocks_total=allocator.num_blocks,
            kv_blocks_free=allocator.num_free,
            kv_block_size=allocator.block_size,
            num_waiting=self.verifier.num_waiting,
        )
        costs_into_proto(self.verifier.costs, msg)
        return msg

    # -------------------------------------------------------------- internals
    @staticmethod
    def _unexpected(call: str, key: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """INTERNAL for what the verifier did not expect, in the caller's terms (grpc's own answer would be UNKNOWN
        with the exception's text, which may name the session's internal key)."""
        log.error("%s of session %s failed", call, describe_key(key), exc_info=exc)
        return grpc.StatusCode.INTERNAL, _as_caller_sees(f"{type(exc).__name__}: {exc}", key)

    def _touch(self, session_id: str) -> None:
        if session_id in self._last_call:
            self._last_call[session_id] = time.monotonic()

    async def background(self) -> None:
        """What runs beside the server: the lease expiry and the --session-ttl reaper."""
        await asyncio.gather(self.expire_leases(), self.reap_idle_sessions())

    async def expire_leases(self) -> None:
        """Release the sessions of leases that ended (their caller is gone) or never attached."""
        while True:
            await asyncio.sleep(LEASE_SWEEP)
            self.leases.keep_only(set(self.verifier.session_ids()))  # those the replica ended itself
            for key in self.leases.expired(time.monotonic()):
                if not self.verifier.has_session(key):
                    continue
                log.info("releasing session %s: its caller's lease ended", describe_key(key))
                self._last_call.pop(key, None)
                await asyncio.wrap_future(self.verifier.submit_release(key))

    async def reap_idle_sessions(self) -> None:
        """Release sessions idle for longer than the TTL (their orchestrator died without Release)."""
        while True:
            await asyncio.sleep(max(0.05, self.session_ttl / 4))
            now = time.monotonic()
            for session_id in self.verifier.session_ids():  # e.g. a Prefill whose caller cancelled
                self._last_call.setdefault(session_id, now)
            cutoff = now - self.session_ttl
            for session_id in [s for s, t in self._last_call.items() if t < cutoff]:
                if self._last_call.get(session_id, now) >= cutoff:  # used while we released others
                    continue
                log.warning("releasing session %s: no call for %.0f s", describe_key(session_id), self.session_ttl)
                self._last_call.pop(session_id, None)
                self.leases.drop_session(session_id)
                await asyncio.wrap_future(self.verifier.submit_release(session_id))


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    models.add_target_arguments(p)
    models.add_runtime_arguments(p)
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (default: 127.0.0.1:50052)")
    p.add_argument("--max-tree-nodes", type=int, default=MAX_TREE_NODES,
                   help=f"largest tree accepted per Verify; larger ones get INVALID_ARGUMENT (default: {MAX_TREE_NODES})")
    p.add_argument("--session-ttl", type=float, default=600.0,
                   help="release a session's KV cache after this many seconds without a call, the backstop for a "
                        "caller without a lease (a caller's Lease stream frees its sessions within seconds of its "
                        "end) (default: 600)")
    p.add_argument("--feedback-topk", type=int, default=8, metavar="K",
                   help="report the target's top-K next tokens after every verified row with each Verify, for "
                        "learning drafters such as Token Recycling (also inside the default fused mix); 0 = off "
                        "(default: 8)")
    add_batching_arguments(p)
    add_grammar_limit_arguments(p)
    p.add_argument("--no-cost-profile", dest="cost_profile", action="store_false",
                   help="do not time a few batched forwards at start-up; without them the orchestrator does not "
                        "shrink speculation trees as this replica's batch grows (default: profile, well under a "
                        "second)")
    add_lookahead_argument(p, "run lookahead decoding's 2-D Jacobi window (N-1 levels of W guess tokens) beside "
                              "every verified tree ((N-1)*W extra rows per forward) and report the N-grams it "
                              "harvests with each Verify, for the lookahead and retrieval drafters (default: off)")
    metrics.add_metrics_argument(p)
    p.add_argument("--model-name", default=None,
                   help="the model's name in the `model_name` label of the metrics and in Info, as `serve --model-name` gives "
                        "it (default: --target as given for a hub id, the directory's name for a local one, `demo` "
                        "for the bundled demo target: what `serve` names the same target)")
    serving.add_server_arguments(p)


def build_servicer(args: argparse.Namespace, registry=None) -> VerifierServicer:
    """The verifier the options describe (the model loaded, its KV pool sized, its costs profiled), its metrics
    in ``registry`` (None: none); the caller closes ``servicer.verifier``. SystemExit with one line on bad
    options."""
    try:
        path = models.model_dir(args.target or models.demo_model("target"))
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    models.set_threads(args.threads)
    try:
        device = models.resolve_device(args.device)
        models.check_dtype_name(args.dtype)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    if args.feedback_topk < 0:
        raise SystemExit(f"specmesh {args.command}: --feedback-topk must be >= 0")
    runner = models.load_runner(path, models.torch_dtype(args.dtype, device), args.runner, device, args.attention,
                                compile_layers=args.compile_layers, cuda_graphs=args.cuda_graphs)
    from verifier_service.step_loop import StepLoop
    from verifier_service.verifier import LocalVerifier

    try:
        from specmesh.grammar import GrammarTokenizer

        grammar = GrammarTokenizer.for_model(path, runner.info.vocab_size, runner.info.eos_token_ids,
                                             grammar_limits(args))
        local = LocalVerifier(runner, args.max_tree_nodes, args.feedback_topk, args.lookahead, args.kv_cache_gb,
                              args.block_size, args.prefill_chunk, prefix_caching=args.prefix_caching,
                              kv_cache_memory=args.kv_cache_memory, profile_rows=args.max_batch_tokens,
                              grammar_tokenizer=grammar)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    costs = None
    if args.cost_profile:
        costs = local.profile_costs()
        log.info("forward costs: %.2f ms + %.3f ms/session + %.3f ms/row", costs.base * 1e3, costs.per_session * 1e3,
                 costs.per_row * 1e3)
    verifier = StepLoop(local, args.max_batch_tokens, args.max_waiting, costs=costs)
    if registry is not None:
        from verifier_service.metrics import VerifierMetrics

        model_name = args.model_name or models.served_name(args.target)
        VerifierMetrics(lambda: [verifier], registry, model_name=model_name)
    log.info("KV pool: %d blocks of %d tokens = %d tokens (%.2f GiB)", local.allocator.num_blocks,
             local.allocator.block_size, local.allocator.num_blocks * local.allocator.block_size,
             local.allocator.num_blocks * local.allocator.block_size * runner.kv_bytes_per_token / 2**30)
    if local.info.max_positions < local.model_positions:
        log.warning("serving a context of %d positions, not the model's %d: one request's KV must fit the pool "
                    "(raise --kv-cache-gb for more)", local.info.max_positions, local.model_positions)
    # Info names the model, never its directory: a caller learns nothing of this machine's file system
    return VerifierServicer(verifier, args.model_name or models.served_name(args.target), args.session_ttl)


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args)
    serving.setup_tracing(args)  # before any server or channel
    security = serving.server_security(args)
    registry = None
    if args.metrics is not None:  # before loading the model: a port in use fails at once
        registry = metrics.new_registry()
        metrics.start_metrics_server(args.metrics, registry, metrics.MetricsAccess.of(args, security.tokens))
    servicer = build_servicer(args, registry)
    try:
        return serving.serve(args, security, servicer, verifier_pb2_grpc.add_VerifierServicer_to_server,
                             VERIFIER_SERVICE, background=servicer.background, drain=servicer.end_leases)
    finally:
        servicer.verifier.close()
