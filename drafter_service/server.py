"""`specmesh drafter`: the Drafter gRPC service, a thin shell over LocalDrafter.

One bidirectional stream per session: OpenSession first, then one DraftResponse
per Propose. The session lives exactly as long as its stream, so a caller that
cancels, times out or dies frees the drafter's state at once. Proposer work runs
on one worker thread (the draft model is not shared across threads).

What one caller can make a drafter hold is bounded: at most ``--max-sessions`` sessions (then
RESOURCE_EXHAUSTED: the orchestrator fails over), each with a context of at most ``--max-context``
tokens, and target features only of positions inside that context, stored by the rows received.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from drafter_service.arguments import add_members_argument, add_store_argument
from drafter_service.draft_kv import DraftKV, add_draft_kv_argument, draft_kv
from drafter_service.drafter import LocalDrafter
from drafter_service.fusion import parse_members
from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import DEFAULT_PROPOSER, Proposer, make_proposer, proposer_names, proposer_spec
from specmesh import metrics, models, serving, tracing
from specmesh.contract import DraftCall, check_prompt_len, check_rollback, check_session_id
from specmesh.feedback import DraftFeedback, TargetFeatures
from specmesh.grammar_limits import add_grammar_limit_arguments, grammar_limits
from specmesh.tree import MAX_TREE_NODES, TokenTree
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc
from specmesh.wire import (
    DRAFTER_SERVICE,
    budget_from_proto,
    draft_feedback_from_proto,
    sampling_from_proto,
    tree_to_proto,
)

log = logging.getLogger("specmesh.drafter")
MAX_FEEDBACK_ITEMS = 64  # verifications' feedback per Propose
MAX_FEEDBACK_NGRAMS = 1024  # harvested n-grams per verification
MAX_NGRAM_LEN = 64
DEFAULT_MAX_CONTEXT = 65536  # tokens a session's context may hold (prompt + committed + drafted-ahead)
DEFAULT_MAX_SESSIONS = 1024  # sessions open at once on one drafter process


class ProposeBatcher:
    """Every session's Propose, run on the one model thread: the calls that arrive while it is busy go together
    when it is free, one ``LocalDrafter.propose_many`` per drafter (a draft model runs one forward per level for all
    of them). Nothing waits for stragglers: a batch starts as soon as the thread is free."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._pending: list[tuple[LocalDrafter, DraftCall, asyncio.Future]] = []
        self._draining = False

    async def propose(self, drafter: LocalDrafter, call: DraftCall) -> TokenTree:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((drafter, call, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                groups: dict[int, tuple[LocalDrafter, list]] = {}
                for drafter, call, future in batch:
                    groups.setdefault(id(drafter), (drafter, []))[1].append((call, future))
                jobs = [(drafter, [call for call, _ in members]) for drafter, members in groups.values()]
                try:
                    outcomes = await loop.run_in_executor(self._executor, _propose_groups, jobs)
                except Exception as exc:  # noqa: BLE001 - every call of the batch gets it
                    outcomes = [[exc] * len(calls) for _, calls in jobs]
                for (_, members), results in zip(groups.values(), outcomes, strict=True):
                    for (_, future), result in zip(members, results, strict=True):
                        if future.done():  # its stream went away
                            continue
                        if isinstance(result, Exception):
                            future.set_exception(result)
                        else:
                            future.set_result(result)
        finally:
            self._draining = False


def _propose_groups(jobs: list[tuple[LocalDrafter, list[DraftCall]]]) -> list[list]:
    """The model thread's part of a batch: one ``propose_many`` per drafter."""
    return [drafter.propose_many(calls) for drafter, calls in jobs]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self, proposers: dict[str, Proposer], default_proposer: str, vocab_size: int = 0, max_tree_nodes: int = MAX_TREE_NODES,
        max_context: int = DEFAULT_MAX_CONTEXT, metrics_registry: CollectorRegistry | None = None,
        feature_hidden: int = 0, max_sessions: int = DEFAULT_MAX_SESSIONS, model_name: str = "demo",
        draft_kv: DraftKV | None = None,
    ) -> None:
        """``metrics_registry``: where to keep Prometheus metrics (``drafter_service/metrics.py``), labelled
        ``model_name`` (the served model drafted for); None = none. ``draft_kv``: the draft model's KV pool, for
        the metrics.
        ``feature_hidden``: the target's hidden size, the width of the target features its feature proposers read
        (0 = not checked). ``max_sessions``: sessions open at once; one more is RESOURCE_EXHAUSTED."""
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if default_proposer not in proposers:
            raise ValueError(f"default proposer {default_proposer!r} is not among {sorted(proposers)}")
        self._drafters = {name: LocalDrafter(p) for name, p in proposers.items()}
        self.default_proposer = default_proposer
        self.vocab_size = vocab_size  # 0 = unknown: token ids are only checked to be >= 0
        self.max_tree_nodes = max_tree_nodes
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.feature_hidden = feature_hidden
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="drafter-model")
        self._batcher = ProposeBatcher(self._executor)
        self.num_sessions = 0
        self.draining = False  # set when this replica is being stopped: new sessions go elsewhere
        self.drafts, self.draft_seconds = 0, 0.0  # proposals answered and their total time (autoscaling reads them)
        self.metrics = None
        if metrics_registry is not None:
            self.metrics = DrafterMetrics(metrics_registry, self.sessions_by_proposer, model_name=model_name,
                                          proposers=self._drafters, draft_kv=draft_kv)

    async def drain(self, timeout: float) -> bool:
        """Refuse new sessions (UNAVAILABLE: the orchestrator fails over) and wait up to ``timeout`` seconds for
        the open ones to end. True if none is left."""
        self.draining = True
        return await serving.wait_until_idle(lambda: self.num_sessions, timeout)

    def sessions_by_proposer(self) -> dict[str, int]:
        return {name: drafter.num_sessions for name, drafter in self._drafters.items()}

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _check_context(self, length: int) -> None:
        """A session's context stays within ``max_context`` tokens (its memory and every proposal's work grow
        with it), or ValueError (INVALID_ARGUMENT)."""
        if length > self.max_context:
            raise ValueError(f"the context would hold {length} tokens; this drafter takes at most {self.max_context} "
                             f"(--max-context)")

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
        rows = 0
        for item in feedback.features:  # a row is a context position's: the session's context bounds them
            rows += len(item)
            if item.start + len(item) > context_length or rows > context_length:
                raise ValueError(f"target features of positions {item.start}..{item.start + len(item) - 1} are past "
                                 f"the session's context of {context_length} tokens (a row is the feature of a "
                                 f"position whose token is in the context)")
            if len(item) and self.feature_hidden and item.rows.shape[1] != self.feature_hidden:
                raise ValueError(f"target features have {item.rows.shape[1]} values per row; this drafter's target "
                                 f"has hidden size {self.feature_hidden}")
            if not np.isfinite(item.rows).all():
                raise ValueError(f"target features of positions {item.start}..{item.start + len(item) - 1} hold "
                                 f"NaN or Inf values")

    async def Session(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this drafter replica is shutting down")
        if self.num_sessions >= self.max_sessions:  # each holds state (a proposer's, a context): bounded
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this drafter holds its maximum of {self.max_sessions} open sessions "
                                f"(--max-sessions); retry later or use another drafter")
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
            check_session_id(opening.session_id)
            prompt = list(opening.prompt)
            self._check_context(len(prompt))
            self._check_tokens(prompt)
            sampling = sampling_from_proto(opening.sampling)
            prompt_len = opening.prompt_len if opening.HasField("prompt_len") else None
            check_prompt_len(prompt_len, len(prompt))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.num_sessions += 1
        # the stream's server span (tracing on): the proposals below are its children
        tracing.current_span().set_attributes({"specmesh.session.id": opening.session_id,
                                               "specmesh.draft.proposer": name})
        try:  # from here on, however the stream ends (even cancelled during open), the session is closed
            with tracing.span("draft_open", {"specmesh.draft.prompt_tokens": len(prompt)}):
                await self._run(drafter.open, session, prompt, sampling, prompt_len)
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
                    self._check_context(drafter.context_length(session) - propose.rollback + len(new_tokens))
                    feedback = draft_feedback_from_proto(propose.feedback, propose.committed_len, propose.features)
                    if feedback is not None:
                        length = drafter.context_length(session) - propose.rollback + len(new_tokens)
                        self._check_feedback(feedback, length)
                        feedback = _features_for(drafter.proposer, feedback)
                    if budget.max_nodes > self.max_tree_nodes:  # a smaller tree fits any budget: clamp
                        budget = dataclasses.replace(budget, max_nodes=self.max_tree_nodes)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                start = time.perf_counter()
                with tracing.span("draft", _draft_attributes(propose, budget)) as span:
                    tree = await self._batcher.propose(drafter, DraftCall(session, new_tokens, budget, propose.rollback,
                                                                          feedback))
                    if span.is_recording():  # a proposer's tree is checked by the orchestrator, not here: depth may fail
                        span.set_attributes({"specmesh.draft.nodes": tree.num_nodes,
                                             "specmesh.draft.depth": _depth_or_none(tree)})
                seconds = time.perf_counter() - start
                if not budget.is_zero:
                    self.drafts += 1
                    self.draft_seconds += seconds
                if self.metrics is not None:
                    self.metrics.proposed(name, tree.num_nodes, seconds, len(feedback.verified) if feedback else 0,
                                          not budget.is_zero)
                yield drafter_pb2.DraftResponse(step=propose.step, tree=tree_to_proto(tree), draft_ms=seconds * 1e3)
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
            feature_proposers=sorted(n for n, d in self._drafters.items() if d.proposer.feedback_features),
        )


def _features_for(proposer: Proposer, feedback: DraftFeedback) -> DraftFeedback:
    """The feedback as ``proposer`` takes it: target features as torch tensors (sharing the decoded arrays) when
    it reads them, else none."""
    if not feedback.features:
        return feedback
    if not proposer.feedback_features:
        return dataclasses.replace(feedback, features=())
    import torch

    return dataclasses.replace(feedback, features=tuple(TargetFeatures(f.start, torch.from_numpy(f.rows))
                                                        for f in feedback.features))


def _depth_or_none(tree) -> int:
    try:
        return tree.max_depth
    except (IndexError, ValueError):  # a malformed tree (its parents are out of range): the orchestrator rejects it
        return -1


def _draft_attributes(propose, budget) -> dict[str, object]:
    """A proposal's span attributes as it starts (its tree's nodes and depth are added at its end; the proposer
    is the stream span's)."""
    return {"specmesh.draft.step": propose.step, "specmesh.draft.budget_nodes": budget.max_nodes,
            "specmesh.draft.budget_depth": budget.max_depth, "specmesh.draft.rollback": propose.rollback}


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None,
                   help="draft model directory for the draft_model proposers, or 'none' to serve model-free "
                        "proposers only (default: the bundled demo draft)")
    models.add_draft_dtype_argument(p, "else float32")
    add_draft_kv_argument(p)
    p.add_argument("--target", type=Path, default=None, metavar="DIR",
                   help="the target model the verifiers serve (a local Hugging Face directory), for proposers that "
                        "share its embedding and LM head (falcon); only those two tables are kept (default: none, "
                        "and those proposers are not served)")
    p.add_argument("--falcon", default=None, metavar="DIR",
                   help="a trained Falcon head (`specmesh train-falcon`) of --target for the falcon proposer "
                        "(default: an untrained head, whose trees are valid but rarely accepted)")
    models.add_runtime_arguments(p)
    p.add_argument("--listen", default="127.0.0.1:50051", help="address to serve on (default: 127.0.0.1:50051)")
    p.add_argument("--proposers", nargs="+", default=None, choices=proposer_names(), metavar="NAME",
                   help=f"proposers to serve ({', '.join(proposer_names())}; default: all, the draft-model ones "
                        "only with a draft model)")
    p.add_argument("--default-proposer", default=None,
                   help=f"proposer for sessions that name none (default: {DEFAULT_PROPOSER} when served, else the "
                        "first of --proposers)")
    p.add_argument("--max-tree-nodes", type=int, default=MAX_TREE_NODES,
                   help=f"largest tree drafted: the drafter's capacity, whatever a budget asks for (default: "
                        f"{MAX_TREE_NODES})")
    p.add_argument("--max-context", type=models.positive_int, default=DEFAULT_MAX_CONTEXT, metavar="TOKENS",
                   help="longest context a session may hold; an Open or Propose beyond it is INVALID_ARGUMENT "
                        f"(default: {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--max-sessions", type=models.positive_int, default=DEFAULT_MAX_SESSIONS, metavar="N",
                   help="sessions open at once; one more is refused with RESOURCE_EXHAUSTED (the orchestrator "
                        f"fails over to its next drafter) (default: {DEFAULT_MAX_SESSIONS})")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer whose fingerprint namespaces the n-gram store (default: the draft model's; "
                        "needed with a shared --ngram-store and --draft none)")
    add_store_argument(p)
    add_members_argument(p)
    add_grammar_limit_arguments(p)
    metrics.add_metrics_argument(p)
    p.add_argument("--model-name", default=None,
                   help="the served model this drafter drafts for, as the `model_name` label of its metrics (as "
                        "`serve --model-name` gives it; default: what `serve` names --target: the directory's name, "
                        "`demo` without --target)")
    serving.add_server_arguments(p)


def _model_dir(args: argparse.Namespace, flag: str, path) -> Path | None:
    """The model directory ``path`` given with ``flag`` (None stays None), or a clear exit."""
    if path is None:
        return None
    try:
        return models.model_dir(path)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {flag}: {exc}") from None


def _draft_dir(args: argparse.Namespace) -> Path | None:
    """The draft model directory (default: the demo draft), or None with --draft none."""
    if args.draft is not None and str(args.draft).lower() == "none":
        return None
    return _model_dir(args, "--draft", args.draft or models.demo_model("draft"))


@dataclass(frozen=True)
class SharedTables:
    """The target's input embedding and LM head modules alone, the rest of its model dropped: what proposers with
    ``needs_target`` share (``falcon_head.target_tables`` reads them as from a Hugging Face causal LM)."""

    embed: Any  # nn.Embedding [vocab, hidden]
    lm_head: Any  # nn.Linear [vocab, hidden]

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    @staticmethod
    def load(path: Path, device) -> SharedTables:
        """Loaded once per drafter, in the checkpoint's own dtype (proposers convert what they use)."""
        model = models.load_model(path, "auto", device)
        return SharedTables(model.get_input_embeddings(), model.get_output_embeddings())


def build_servicer(args: argparse.Namespace, metrics_registry: CollectorRegistry | None = None) -> DrafterServicer:
    draft_dir, target_dir = _draft_dir(args), _model_dir(args, "--target", args.target)
    needs_draft = {n for n in proposer_names() if proposer_spec(n).needs_draft_model}
    needs_target = {n for n in proposer_names() if proposer_spec(n).needs_target}
    names = args.proposers or [n for n in proposer_names() if (draft_dir is not None or n not in needs_draft)
                               and (target_dir is not None or n not in needs_target)]
    missing = [n for n in names if n in needs_draft and draft_dir is None]
    if missing:
        raise SystemExit(f"specmesh drafter: {', '.join(missing)} need a draft model (--draft DIR)")
    try:
        members = parse_members(args.members) if "fused" in names else []  # what fused drafts with (needs too)
    except ValueError as exc:
        raise SystemExit(f"specmesh drafter: {exc}") from None
    missing = [n for n in dict.fromkeys([*names, *members]) if n in needs_target and target_dir is None]
    if missing:  # a Falcon head shares the target's embedding and LM head, and reads the verifier's features of it
        raise SystemExit(f"specmesh drafter: {', '.join(missing)} needs the target model it drafts for: --target DIR "
                         "(the checkpoint the verifiers serve; its embedding and LM head are shared)")
    if args.falcon and "falcon" not in names and "falcon" not in members:
        raise SystemExit("specmesh drafter: --falcon is for the falcon proposer (--proposers ... falcon, or "
                         "fused with --members ...+falcon)")
    draft_runner = tables = None
    shares_target = target_dir is not None and bool(needs_target & {*names, *members})  # load its tables
    if draft_dir is not None or shares_target:
        models.bound_kernel_caches()  # before the first product: a drafter's shapes would fill them (models.py)
        models.set_threads(args.threads)
        try:
            device = models.resolve_device(args.device)
        except ValueError as exc:
            raise SystemExit(f"specmesh {args.command}: {exc}") from None
        if draft_dir is not None:
            draft_runner = models.load_runner(draft_dir, models.draft_dtype(args.draft_dtype, "float32", device),
                                              args.runner, device, args.attention,
                                              compile_layers=args.compile_layers, cuda_graphs=args.cuda_graphs)
            draft_kv(draft_runner, args.draft_kv_cache_gb)  # the pool, before any session (draft_kv.py)
        if shares_target:
            tables = SharedTables.load(target_dir, device)
    elif target_dir is not None:
        log.warning("--target is unused: no served proposer needs it (%s)", ", ".join(sorted(needs_target)))
    vocab = draft_runner.info.vocab_size if draft_runner is not None else 0
    hidden = 0
    if tables is not None:
        target_vocab, hidden = tables.lm_head.weight.shape[0], tables.embed.weight.shape[1]
        if vocab and vocab != target_vocab:
            raise SystemExit(f"specmesh drafter: the draft's vocabulary ({vocab}) differs from the target's "
                             f"({target_vocab})")
        vocab = target_vocab
    if ("falcon" in names or "falcon" in members) and not args.falcon:
        log.warning("falcon: no --falcon head given: an untrained head drafts (valid trees, rarely accepted)")
    default = args.default_proposer or (DEFAULT_PROPOSER if DEFAULT_PROPOSER in names else names[0])
    falcon = {"head": args.falcon} if args.falcon else {}
    options = {"fused": {**({"members": args.members} if args.members else {}),  # a falcon member: the same head
                         **({f"falcon.{k}": v for k, v in falcon.items()} if "falcon" in members else {})},
               "falcon": falcon}
    try:
        grammar = None
        model_dir = target_dir or draft_dir
        if model_dir is not None and vocab:  # structured output's tokenizer: the models share it
            from specmesh.grammar import GrammarTokenizer

            eos = draft_runner.info.eos_token_ids if draft_runner is not None else ()  # else: the tokenizer's
            grammar = GrammarTokenizer.for_model(model_dir, vocab, eos, grammar_limits(args))
        resources = dict(draft_runner=draft_runner, target_runner=tables, store=_open_store(args, draft_dir),
                         grammar_tokenizer=grammar)
        proposers = {n: make_proposer(n, **resources, **options.get(n, {})) for n in names}
    except ValueError as exc:
        raise SystemExit(f"specmesh drafter: {exc}") from None
    try:
        return DrafterServicer(proposers, default, vocab, args.max_tree_nodes, args.max_context, metrics_registry,
                               feature_hidden=hidden, max_sessions=args.max_sessions,
                               model_name=args.model_name or models.served_name(args.target),
                               draft_kv=draft_kv(draft_runner) if draft_runner is not None else None)
    except ValueError as exc:
        raise SystemExit(f"specmesh drafter: {exc}") from None


def _open_store(args: argparse.Namespace, draft_dir: Path | None):
    """The n-gram store every store-backed proposer of this drafter shares. Its namespace is the vocabulary's
    fingerprint, read with the ``tokenizers`` library where the directory allows it (transformers' tokenizer
    classes took 4 of a drafter's 10 seconds of start-up, importing its modelling code, for the same vocabulary)."""
    from drafter_service.ngram_store import open_store, tokenizer_fingerprint
    from specmesh.text_tokenizer import load_text_tokenizer

    source = args.tokenizer or draft_dir
    namespace = "default"
    if source is not None:
        namespace = tokenizer_fingerprint(load_text_tokenizer(source).get_vocab())
    elif args.ngram_store not in (None, "memory"):
        log.warning("no --tokenizer: the n-gram store namespace is 'default', shared with any other model")
    return open_store(args.ngram_store, namespace)


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args)
    serving.setup_tracing(args)  # before any server or channel
    security = serving.server_security(args)
    registry = None
    if args.metrics is not None:  # before loading anything: a port in use fails at once
        registry = metrics.new_registry()
        metrics.start_metrics_server(args.metrics, registry, metrics.MetricsAccess.of(args, security.tokens))
    servicer = build_servicer(args, registry)
    log.info("proposers: %s (default %s)", ", ".join(sorted(servicer._drafters)), servicer.default_proposer)
    return serving.serve(args, security, servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, DRAFTER_SERVICE)
