"""`specmesh drafter`: the Drafter gRPC service, a thin shell over LocalDrafter.

One bidirectional stream per session: OpenSession first, then one DraftResponse
per Propose. The session lives exactly as long as its stream, so a caller that
cancels, times out or dies frees the drafter's state at once. Proposer work runs
on one worker thread (the draft model is not shared across threads).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from drafter_service.drafter import LocalDrafter, check_rollback
from drafter_service.proposer import Proposer
from specmesh import serving
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc
from specmesh.wire import budget_from_proto, draft_feedback_from_proto, sampling_from_proto, tree_to_proto

log = logging.getLogger("specmesh.drafter")
MAX_FEEDBACK_ITEMS = 64  # verifications' feedback per Propose
MAX_FEEDBACK_NGRAMS = 1024  # harvested n-grams per verification
MAX_NGRAM_LEN = 64
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self, proposers: dict[str, Proposer], default_proposer: str, vocab_size: int = 0, max_tree_nodes: int = 256
    ) -> None:
        if default_proposer not in proposers:
            raise ValueError(f"default proposer {default_proposer!r} is not among {sorted(proposers)}")
        self._drafters = {name: LocalDrafter(p) for name, p in proposers.items()}
        self.default_proposer = default_proposer
        self.vocab_size = vocab_size  # 0 = unknown: token ids are only checked to be >= 0
        self.max_tree_nodes = max_tree_nodes
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="drafter-model")
        self.num_sessions = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _check_tokens(self, tokens) -> None:
        limit = self.vocab_size or 2**31  # model-free drafters know no vocabulary: ids must fit the stores
        if tokens and (min(tokens) < 0 or max(tokens) >= limit):
            raise ValueError(f"token ids must be in [0, {limit})")

    def _check_feedback(self, feedback, context_length: int) -> None:
        """Feedback feeds state shared by every session (adjacency tables, the fleet store): bounded
        sizes and token ids in range, or ValueError (INVALID_ARGUMENT)."""
        if feedback.committed_len > context_length:
            raise ValueError(f"committed_len {feedback.committed_len} exceeds the context's {context_length} tokens")
        if len(feedback.verified) > MAX_FEEDBACK_ITEMS:
            raise ValueError(f"at most {MAX_FEEDBACK_ITEMS} feedback items per proposal")
        for item in feedback.verified:
            if item.inputs.shape[0] > 4 * self.max_tree_nodes or len(item.ngrams) > MAX_FEEDBACK_NGRAMS:
                raise ValueError("feedback item too large")
            self._check_tokens(item.inputs.tolist())
            self._check_tokens(item.topk.reshape(-1).tolist())
            for gram in item.ngrams:
                if len(gram) > MAX_NGRAM_LEN:
                    raise ValueError(f"feedback n-grams are at most {MAX_NGRAM_LEN} tokens")
                self._check_tokens(list(gram))

    async def Session(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be `open`")
        opening = first.open
        name = opening.proposer or self.default_proposer
        drafter = self._drafters.get(name)
        if drafter is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown proposer {name!r}; this drafter runs {', '.join(sorted(self._drafters))}")
        # our own key: session ids from different callers may collide
        session = f"{opening.session_id}/{uuid.uuid4().hex[:8]}"
        try:
            prompt = list(opening.prompt)
            self._check_tokens(prompt)
            sampling = sampling_from_proto(opening.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.num_sessions += 1
        try:  # from here on, however the stream ends (even cancelled during open), the session is closed
            await self._run(drafter.open, session, prompt, sampling)
            async for request in request_iterator:
                if request.WhichOneof("kind") != "propose":
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "only `propose` may follow `open`")
                propose = request.propose
                try:
                    new_tokens = list(propose.new_tokens)
                    self._check_tokens(new_tokens)
                    budget = budget_from_proto(propose.budget, time.monotonic())
                    # checked here, as it will be applied (proposals run one at a time), to answer
                    # INVALID_ARGUMENT rather than fail on the model thread
                    check_rollback(propose.rollback, drafter.context_length(session))
                    feedback = draft_feedback_from_proto(propose.feedback, propose.committed_len)
                    if feedback is not None:
                        length = drafter.context_length(session) - propose.rollback + len(new_tokens)
                        self._check_feedback(feedback, length)
                    if budget.max_nodes > self.max_tree_nodes:  # a smaller tree fits any budget: clamp
                        budget = dataclasses.replace(budget, max_nodes=self.max_tree_nodes)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                start = time.perf_counter()
                tree = await self._run(drafter.propose, session, new_tokens, budget, propose.rollback, feedback)
                yield drafter_pb2.DraftResponse(
                    step=propose.step, tree=tree_to_proto(tree), draft_ms=(time.perf_counter() - start) * 1e3
                )
        finally:
            self.num_sessions -= 1
            # queued behind any running proposal on the model thread; not awaited, so it
            # also runs when this stream was cancelled
            self._executor.submit(drafter.close, session)

    async def Info(self, request, context):
        return drafter_pb2.DrafterInfo(
            proposers=sorted(self._drafters),
            default_proposer=self.default_proposer,
            vocab_size=self.vocab_size,
            num_sessions=self.num_sessions,
        )


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from drafter_service.proposer import proposer_names
    p.add_argument("--listen", default="127.0.0.1:50051", help="address to serve on (default: 127.0.0.1:50051)")
    p.add_argument("--proposers", nargs="+", default=None, choices=proposer_names(), metavar="NAME",
                   help=f"proposers to serve ({', '.join(proposer_names())}; default: all, the draft-model ones "
                        "only with a draft model)")
    p.add_argument("--default-proposer", default=None,
                   help="proposer for sessions that name none (default: draft_model with a draft model, "
                        "else prompt_lookup)")
    p.add_argument("--max-tree-nodes", type=int, default=256,
                   help="largest tree drafted; larger budgets are clamped to it (default: 256)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer whose fingerprint namespaces the n-gram store (default: the draft model's; "
                        "needed with a shared --ngram-store and --draft none)")
    from specmesh.cli import add_members_argument, add_store_argument

    add_store_argument(p)
    add_members_argument(p)
    serving.add_server_arguments(p)


def build_servicer(args: argparse.Namespace) -> DrafterServicer:
    from drafter_service.proposer import make_proposer, proposer_names
    from orchestrator.embedded import NEEDS_DRAFT_MODEL
    from specmesh.cli import load_draft_runner

    draft_runner = load_draft_runner(args)
    names = args.proposers or [n for n in proposer_names() if draft_runner is not None or n not in NEEDS_DRAFT_MODEL]
    missing = [n for n in names if n in NEEDS_DRAFT_MODEL and draft_runner is None]
    if missing:
        raise SystemExit(f"specmesh drafter: {', '.join(missing)} need a draft model (--draft DIR)")
    default = args.default_proposer or ("draft_model" if "draft_model" in names else
                                        "prompt_lookup" if "prompt_lookup" in names else names[0])
    try:
        resources = dict(draft_runner=draft_runner, store=_open_store(args))
        proposers = {n: make_proposer(n, **resources, **({"members": args.members} if n == "fused" and args.members
                                                          else {})) for n in names}
    except ValueError as exc:
        raise SystemExit(f"specmesh drafter: {exc}") from None
    vocab = draft_runner.info.vocab_size if draft_runner is not None else 0
    try:
        return DrafterServicer(proposers, default, vocab, args.max_tree_nodes)
    except ValueError as exc:
        raise SystemExit(f"specmesh drafter: {exc}") from None


def _open_store(args: argparse.Namespace):
    """The n-gram store every store-backed proposer of this drafter shares."""
    from drafter_service.ngram_store import open_store, tokenizer_fingerprint
    from specmesh.cli import demo_model
    from specmesh.model_runner import load_tokenizer

    source = args.tokenizer or (None if str(args.draft).lower() == "none" else args.draft or demo_model("draft"))
    namespace = "default"
    if source is not None:
        namespace = tokenizer_fingerprint(load_tokenizer(source).get_vocab())
    elif args.ngram_store not in (None, "memory"):
        log.warning("no --tokenizer: the n-gram store namespace is 'default', shared with any other model")
    return open_store(args.ngram_store, namespace)


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args)
    security = serving.server_security(args)
    servicer = build_servicer(args)
    log.info("proposers: %s (default %s)", ", ".join(sorted(servicer._drafters)), servicer.default_proposer)
    return serving.serve(args, security, servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME)
