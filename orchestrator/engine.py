"""The per-request speculation loop: prefill -> (propose -> verify -> commit)* -> stop.

No product path runs this engine: `specmesh generate`, `bench`, `serve` and the benchmarks run their requests on
the engine core (orchestrator/core.py; ``EmbeddedStack.engine`` returns a ``CoreEngine``). It is kept as the tests'
oracle of greedy equality (``tests/spec_helpers.engine_for``; the tests of its PEARL loop and drafter failover
still run on it) and as the "before the engine core" comparison of ``benchmarks/engine_overhead.py --engines
threads``. Its ``StepEvent`` and ``GenerationResult`` are the types the core emits as well.

The engine only sees the Drafter and Verifier interfaces; whether they run in
this process, behind gRPC or on Ray is decided by whoever builds the engine.
Plain autoregressive decoding is the same loop with no drafter (empty trees).

With ``overlap=True`` the loop is PEARL's: drafter calls run on a background
worker, and while the verifier checks tree t the drafter already drafts the next
tree on the assumption that t's main line is accepted (orchestrator/overlap.py).
When the verifier agrees, the next step starts at once with that tree; otherwise
the drafter is rolled back and drafts from the verified point (a ``restart``, for
which the policy may pick a short tree so the verifier starts early: pre-verify).

A drafter that fails (raises, times out, or returns a tree that breaks the
contract) never fails the request: the step is verified without a tree, the error
is recorded in the step's stats, and the next drafter candidate takes over, or, with
none left, the request decodes plainly (orchestrator/drafter_link.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from orchestrator.drafter_link import DrafterCandidate, DrafterLink
from orchestrator.overlap import predraft_budget, reusable_subtree
from orchestrator.policy import SpeculationPolicy, StaticPolicy, reads_ranks
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import StopChecker
from orchestrator.tracing_steps import PREFILL_SPAN, STEP_SPAN, step_attributes, step_start_attributes
from specmesh import tracing
from specmesh.contract import Budget, TokenLogprobs, Verifier, VerifyResult
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree


@dataclass(slots=True)  # not frozen: one per request and step (a frozen init costs 2x)
class StepEvent:
    tokens: tuple[int, ...]  # tokens to emit to the client now
    step: StepStats | None  # None for the prefill's first token
    text_limit: int | None = None  # a stop string matched: cut the decoded text here
    logprobs: TokenLogprobs | None = None  # of ``tokens``, when the request asks (SamplingParams.logprobs)


def emitted_logprobs(logprobs: TokenLogprobs | None, emitted: int) -> TokenLogprobs | None:
    """The log-probabilities of the tokens a step lets out (a stop condition may end it early)."""
    return None if logprobs is None else logprobs.head(emitted)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    text_limit: int | None = None  # cut decoded text here (a stop string matched)
    events: list[StepEvent] = field(default_factory=list, repr=False)


class Engine:
    def __init__(
        self,
        verifier: Verifier,
        drafters: Sequence[DrafterCandidate] = (),
        policy: SpeculationPolicy | None = None,
        decode: Callable[[list[int]], str] | None = None,
        overlap: bool = False,
        ahead_from: str = "path",
        strict: bool = False,
        features: bool = False,
    ) -> None:
        """``drafters``: the drafter candidates in order of preference (``drafter_link.only(drafter)`` for
        one; none = plain decoding). ``policy``: how much to speculate per step (``policy.build_policy``),
        required with drafters. ``strict``: a drafter failure fails the request instead of failing over
        (tests and proposer debugging: a drafter bug cannot hide behind plain decoding). ``features``: ask the
        verifier for the target's features of the request's committed tokens and hand them to the drafter
        (a feature-based drafter: Falcon heads)."""
        if policy is None and drafters:
            raise ValueError("an engine with drafters needs a speculation policy (orchestrator.policy.build_policy)")
        self.verifier = verifier
        self.drafters = list(drafters)
        self.policy = policy or StaticPolicy(0, 0)
        self.decode = decode
        self.overlap = overlap  # PEARL: draft the next tree while the current one is verified
        # what drafting ahead assumes: "path" = the tree's main line is accepted (PEARL);
        # "context" = nothing: a deeper tree from the committed context covers every outcome
        self.ahead_from = ahead_from
        self.strict = strict
        self.features = features

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams, result: GenerationResult | None = None
    ) -> Iterator[StepEvent]:
        """Yield emitted tokens step by step. Pass ``result`` to have it filled in as the stream ends."""
        result = result if result is not None else GenerationResult([], "", RequestStats())
        stats = result.stats
        stats.prompt_tokens = len(prompt)
        stats.acceptance = sampling.acceptance  # lossy (mjsd) or exact: the request's stats say which
        stopper = StopChecker(sampling, self.verifier.info.eos_token_ids, self.decode)
        session, committed = uuid.uuid4().hex, []
        background = self.overlap and bool(self.drafters)
        link = DrafterLink(self.drafters, session, self.verifier.info.vocab_size, committed, background, self.strict)
        req = _Request(self, session, stopper, stats, committed, link)
        start = time.perf_counter()
        try:  # the finally releases the verifier session even when prefill itself fails
            # with a background worker the drafter opens first: its prefill (draft model) runs on the worker,
            # or in the drafter's process, while the verifier prefills; without one it opens after the first
            # token is out, so that token does not wait for the draft prefill
            if background:
                req.link.open(prompt, sampling)
            with tracing.span(PREFILL_SPAN, {"specmesh.session.id": session,
                                             "specmesh.prefill.prompt_tokens": len(prompt)}):
                prefill = self.verifier.prefill(req.session, prompt, sampling, features=self.features)
            stats.prefill_seconds = prefill.seconds
            if prefill.features is not None:  # the prompt's target features, for feature-based drafters
                req.link.add_features(prefill.features)
            req.committed.append(prefill.first_token)
            emitted = stopper.push([prefill.first_token])
            yield StepEvent(tuple(emitted), None, logprobs=emitted_logprobs(prefill.logprobs, len(emitted)))
            if not background:
                req.link.open(prompt, sampling)
            req.link.wait_open()
            steps = self._overlapped(req) if background else self._sequential(req)
            for step, verified in steps:
                stats.steps.append(step)
                emitted = stopper.push(verified.tokens)
                result.text_limit = stopper.text_limit  # known before the last event goes out
                yield StepEvent(tuple(emitted), step, logprobs=emitted_logprobs(verified.logprobs, len(emitted)))
        finally:
            req.link.close(len(stopper.generated))
            self.verifier.release(req.session)
            stats.total_seconds = time.perf_counter() - start
            stats.num_generated = len(stopper.generated)
            result.token_ids = list(stopper.generated)
            result.finish_reason = stopper.finish_reason or "aborted"
            result.text_limit = stopper.text_limit

    def generate(self, prompt: Sequence[int], sampling: SamplingParams) -> GenerationResult:
        result = GenerationResult([], "", RequestStats())
        for event in self.stream(prompt, sampling, result):
            result.events.append(event)
        return result

    # ------------------------------------------------------------------ loops
    def _sequential(self, req: _Request) -> Iterator[tuple[StepStats, VerifyResult]]:
        """Draft, then verify; each side waits for the other."""
        while not req.stopper.done:
            with req.step_span() as span:  # ends before the yield
                t_step = time.perf_counter()
                budget = self.policy.next_budget(req.stats, req.stopper.remaining, "sequential")
                tree, draft_seconds = TokenTree.empty(), 0.0
                if req.link.active and not budget.is_zero:
                    t0 = time.perf_counter()
                    tree, _ = req.link.draft(budget)
                    draft_seconds = time.perf_counter() - t0
                tree, verified = req.verify(tree)
                step = req.step_stats(tree, verified, budget, t_step, draft_seconds=draft_seconds,
                                      wait_seconds=draft_seconds, drafter_busy_seconds=draft_seconds)
                req.trace_step(span, step)
            yield step, verified

    def _overlapped(self, req: _Request) -> Iterator[tuple[StepStats, VerifyResult]]:
        """PEARL: while tree t is verified, draft the tree after t's main line (post-verify)."""
        link = req.link
        ready: TokenTree | None = None  # drafted ahead, usable as this step's tree
        ready_budget, ready_seconds = Budget(0, 0), 0.0
        while not req.stopper.done:
            with req.step_span() as span:  # ends before the yield
                t_step = time.perf_counter()
                tree, wait, busy = TokenTree.empty(), 0.0, 0.0
                budget, predrafted = ready_budget, ready is not None
                if ready is not None:
                    tree, draft_seconds = ready, ready_seconds
                else:
                    budget = self.policy.next_budget(req.stats, req.stopper.remaining, "restart")
                    if link.active and not budget.is_zero:
                        t0 = time.perf_counter()
                        tree, busy = link.draft(budget)
                        wait = time.perf_counter() - t0
                    draft_seconds = busy
                # draft ahead, assuming the verifier accepts this tree's main line
                path = tree.main_path()
                hypothesis = tree.tokens[path].tolist() if self.ahead_from == "path" else []
                pending, ahead, pre_budget = None, Budget(0, 0), Budget(0, 0)
                if link.active:
                    ahead = self.policy.next_budget(req.stats, req.stopper.remaining - len(path) - 1, "predraft")
                    if not ahead.is_zero:
                        # greedy: the pre-draft stops when the verification ends (the tree's contents never
                        # change the output); sampling: it runs to its budget (static policy, no draft
                        # deadline: a seed reproduces the output), stopped early only when the request ends
                        stop = threading.Event()
                        pre_budget = predraft_budget(ahead, stop, len(path) + 1 - len(hypothesis))
                        pending = link.start(pre_budget, hypothesis, stop)
                tree, verified = req.verify(tree)
                pre_tree, pre_seconds = link.collect(pending)
                busy += pre_seconds
                ready = None
                if pre_tree is not None:
                    ready = reusable_subtree(pre_tree, hypothesis, verified.tokens, ahead.max_nodes)
                ready_budget, ready_seconds = ahead, pre_seconds
                step = req.step_stats(
                    tree, verified, budget, t_step, draft_seconds=draft_seconds, wait_seconds=wait,
                    drafter_busy_seconds=busy, predrafted=predrafted,
                    predraft_nodes=pre_tree.num_nodes if pre_tree is not None else 0,
                    predraft_used=ready.num_nodes if ready is not None else 0,
                    predraft_levels=pre_tree.max_depth if pre_tree is not None else 0,
                    predraft_seconds=pre_seconds,
                    ahead_confirmed=pre_tree is not None and len(verified.tokens) > len(hypothesis)
                    and list(verified.tokens[: len(hypothesis)]) == hypothesis,
                )
                req.trace_step(span, step)
            yield step, verified


@dataclass
class _Request:
    """One request's state, shared by both loops: its verifier session, the committed tokens, the
    link to its drafter, and the stats."""

    engine: Engine
    session: str
    stopper: StopChecker
    stats: RequestStats
    committed: list[int]  # every token committed after the prompt
    link: DrafterLink
    draft_cpu_counted: float = 0.0  # the link's drafting CPU seconds already attributed to a step

    def step_span(self):
        """The next step's span (orchestrator/tracing_steps.py), current inside the ``with`` block."""
        return tracing.span(STEP_SPAN, step_start_attributes(len(self.stats.steps), self.link.drafter_name))

    @staticmethod
    def trace_step(span, step: StepStats) -> None:
        if span.is_recording():
            span.set_attributes(step_attributes(step))

    def verify(self, tree: TokenTree) -> tuple[TokenTree, VerifyResult]:
        """Verify ``tree`` and commit the result; a tree the verifier calls malformed fails the drafter over."""
        verifier = self.engine.verifier
        try:
            verified = verifier.verify(self.session, tree)
        except InvalidTreeError as exc:
            self.link.fail(InvalidTreeError(str(exc)))
            tree = TokenTree.empty()
            verified = verifier.verify(self.session, tree)
        self.committed += verified.tokens
        if verified.feedback is not None:
            self.link.add_feedback(verified.feedback)
        if verified.features is not None:
            self.link.add_features(verified.features)
        return tree, verified

    def step_stats(self, tree: TokenTree, verified: VerifyResult, budget: Budget, t_step: float, **extra) -> StepStats:
        cpu, self.draft_cpu_counted = self.link.worker.cpu_seconds - self.draft_cpu_counted, self.link.worker.cpu_seconds
        return StepStats(
            num_proposed=tree.num_nodes,
            tree_depth=tree.max_depth,
            num_accepted=verified.num_accepted,
            accepted_sources=tuple(tree.sources[i] for i in verified.accepted_nodes) if tree.sources else (),
            accepted_ranks=tree.path_ranks(verified.accepted_nodes) if reads_ranks(self.engine.policy) else None,
            proposed_sources=tree.sources,
            verify_seconds=verified.seconds,
            draft_error=self.link.take_errors(),
            budget=(budget.max_nodes, budget.max_depth),
            step_seconds=time.perf_counter() - t_step,
            batch_sessions=verified.batch_sessions,
            draft_cpu_seconds=cpu,
            **extra,
        )
