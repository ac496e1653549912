"""The per-request speculation loop: prefill -> (propose -> verify -> commit)* -> stop.

The engine only sees the Drafter and Verifier interfaces; whether they run in
this process, behind gRPC or on Ray is decided by whoever builds the engine.
Plain autoregressive decoding is the same loop with no drafter (empty trees).

With ``overlap=True`` the loop is PEARL's: drafter calls run on a background
worker, and while the verifier checks tree t the drafter already drafts the next
tree on the assumption that t's main line is accepted (orchestrator/overlap.py).
When the verifier agrees, the next step starts at once with that tree; otherwise
the drafter is rolled back and drafts from the verified point (a ``restart``, for
which the policy may pick a short tree so the verifier starts early: pre-verify).

A drafter that fails (raises, or returns a tree the verifier rejects as
malformed) never fails the request: the step falls back to plain decoding, the
error is recorded in the step's stats, and the drafter is dropped for the rest
of the request.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from drafter_service.drafter import Drafter
from drafter_service.proposer import Budget
from orchestrator.overlap import DraftContext, DraftWorker, predraft_budget, reusable_subtree
from orchestrator.policy import SpeculationPolicy, StaticPolicy
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import StopChecker
from specmesh.feedback import DraftFeedback, VerifyFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from verifier_service.verifier import Verifier, VerifyResult

SYNC_TIMEOUT_S = 0.5  # the context sync before a drafter session closes
MAX_UNSENT_FEEDBACK = 16  # verifications' feedback kept for the next drafter call (zero budgets send none)


@dataclass(frozen=True)
class StepEvent:
    tokens: tuple[int, ...]  # tokens to emit to the client now
    step: StepStats | None  # None for the prefill's first token


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
        drafter: Drafter | None = None,
        policy: SpeculationPolicy | None = None,
        decode: Callable[[list[int]], str] | None = None,
        overlap: bool = False,
        ahead_from: str = "path",
        max_draft_nodes: int | None = None,
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.policy = policy or StaticPolicy()
        self.decode = decode
        self.overlap = overlap  # PEARL: draft the next tree while the current one is verified
        # what drafting ahead assumes: "path" = the tree's main line is accepted (PEARL);
        # "context" = nothing: a deeper tree from the committed context covers every outcome
        self.ahead_from = ahead_from
        self.max_draft_nodes = max_draft_nodes  # the drafter's limit: drafting ahead asks for a bigger tree

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams, result: GenerationResult | None = None
    ) -> Iterator[StepEvent]:
        """Yield emitted tokens step by step. Pass ``result`` to have it filled in as the stream ends."""
        result = result if result is not None else GenerationResult([], "", RequestStats())
        stats = result.stats
        stats.prompt_tokens = len(prompt)
        stopper = StopChecker(sampling, self.verifier.info.eos_token_ids, self.decode)
        req = _Request(self, uuid.uuid4().hex, self.drafter, stopper, stats, sampling.greedy, len(prompt))
        if self.overlap and self.drafter is not None:
            req.worker = DraftWorker(self.drafter)
        start = time.perf_counter()
        try:  # the finally releases the verifier session even when prefill itself fails
            # with a worker the drafter opens first: its prefill (draft model) runs on the worker, or
            # in the drafter's process, while the verifier prefills; without one it opens after the
            # first token is out, so that token does not wait for the draft prefill
            opening = req.open(prompt, sampling) if req.worker is not None else None
            prefill = self.verifier.prefill(req.session, prompt, sampling)
            stats.prefill_seconds = prefill.seconds
            req.committed.append(prefill.first_token)
            yield StepEvent(tuple(stopper.push([prefill.first_token])), None)
            if req.worker is None:
                req.open(prompt, sampling)
            req.opened(opening)
            steps = self._overlapped(req) if req.worker is not None else self._sequential(req)
            for step, tokens in steps:
                stats.steps.append(step)
                emitted = stopper.push(tokens)
                result.text_limit = stopper.text_limit  # known before the last event goes out
                yield StepEvent(tuple(emitted), step)
        finally:
            req.finish()
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
    def _sequential(self, req: _Request) -> Iterator[tuple[StepStats, tuple[int, ...]]]:
        """Draft, then verify; each side waits for the other."""
        while not req.stopper.done:
            t_step = time.perf_counter()
            budget = self.policy.next_budget(req.stats, req.stopper.remaining, "sequential")
            tree, draft_seconds = TokenTree.empty(), 0.0
            if req.drafter is not None and not budget.is_zero:
                t0 = time.perf_counter()
                tree = req.draft_now(budget)
                draft_seconds = time.perf_counter() - t0
            tree, verified = req.verify(tree)
            yield req.step_stats(tree, verified, budget, t_step, draft_seconds=draft_seconds,
                                 wait_seconds=draft_seconds, drafter_busy_seconds=draft_seconds), verified.tokens

    def _overlapped(self, req: _Request) -> Iterator[tuple[StepStats, tuple[int, ...]]]:
        """PEARL: while tree t is verified, draft the tree after t's main line (post-verify)."""
        ready: TokenTree | None = None  # drafted ahead, usable as this step's tree
        ready_budget, ready_seconds = Budget(0, 0), 0.0
        while not req.stopper.done:
            t_step = time.perf_counter()
            tree, wait, busy = TokenTree.empty(), 0.0, 0.0
            budget, predrafted = ready_budget, ready is not None
            if ready is not None:
                tree, draft_seconds = ready, ready_seconds
            else:
                budget = self.policy.next_budget(req.stats, req.stopper.remaining, "restart")
                if req.drafter is not None and not budget.is_zero:
                    t0 = time.perf_counter()
                    tree, busy = req.draft_on_worker(budget)
                    wait = time.perf_counter() - t0
                draft_seconds = busy
            # draft ahead, assuming the verifier accepts this tree's main line
            path = tree.main_path()
            hypothesis = tree.tokens[path].tolist() if self.ahead_from == "path" else []
            pending, ahead, pre_budget = None, Budget(0, 0), Budget(0, 0)
            if req.drafter is not None:
                ahead = self.policy.next_budget(req.stats, req.stopper.remaining - len(path) - 1, "predraft")
                if not ahead.is_zero:
                    # greedy: the pre-draft stops when the verification ends (the tree's contents never
                    # change the output); sampling: it runs to its budget (static policy, no draft
                    # deadline: a seed reproduces the output), stopped early only when the request ends
                    req.stop_event = threading.Event()
                    pre_budget = predraft_budget(ahead, req.stop_event, len(path) + 1 - len(hypothesis),
                                                 self.max_draft_nodes)
                    pending = req.start_draft(pre_budget, hypothesis)
            tree, verified = req.verify(tree)
            pre_tree, pre_seconds = req.collect(pending, pre_budget)
            busy += pre_seconds
            ready = None
            if pre_tree is not None and req.drafter is not None:
                ready = reusable_subtree(pre_tree, hypothesis, verified.tokens, ahead.max_nodes)
            ready_budget, ready_seconds = ahead, pre_seconds
            yield req.step_stats(
                tree, verified, budget, t_step, draft_seconds=draft_seconds, wait_seconds=wait,
                drafter_busy_seconds=busy, predrafted=predrafted,
                predraft_nodes=pre_tree.num_nodes if pre_tree is not None else 0,
                predraft_used=ready.num_nodes if ready is not None else 0,
                predraft_levels=pre_tree.max_depth if pre_tree is not None else 0,
                predraft_seconds=pre_seconds,
                ahead_confirmed=pre_tree is not None and len(verified.tokens) > len(hypothesis)
                and list(verified.tokens[: len(hypothesis)]) == hypothesis,
            ), verified.tokens


@dataclass
class _Request:
    """One request's state, shared by both loops: the drafter in use (None once it failed),
    what it holds, the committed tokens, and the error to report with the next step."""

    engine: Engine
    session: str
    drafter: Drafter | None
    stopper: StopChecker
    stats: RequestStats
    greedy: bool
    prompt_len: int
    worker: DraftWorker | None = None
    committed: list[int] = field(default_factory=list)  # every token committed after the prompt
    view: DraftContext = field(default_factory=DraftContext)
    error: str = ""  # a drafter failure not yet reported in a step
    stop_event: threading.Event | None = None  # ends the pre-draft in flight
    unsent: list[VerifyFeedback] = field(default_factory=list)  # verifier feedback not yet given to the drafter

    def open(self, prompt: Sequence[int], sampling: SamplingParams):
        """Start opening the drafter session; pass the result to ``opened``."""
        if self.drafter is None:
            return None
        if self.worker is not None:
            return self.worker.submit("open", self.session, prompt, sampling)
        try:
            self.drafter.open(self.session, prompt, sampling)
        except Exception as exc:  # an unreachable drafter: decode without it
            self.fail(exc)
        return None

    def opened(self, opening) -> None:
        if opening is not None:
            try:
                opening.result()
            except Exception as exc:
                self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Record a drafter failure and decode without it from now on."""
        self.error = f"{type(exc).__name__}: {exc}"
        self.close_drafter()

    def close_drafter(self, sync: bool = False) -> None:
        """Close the drafter session; with ``sync``, first bring its context to exactly the tokens
        the request committed and emitted (with the last feedback), so proposers that learn from
        finished sessions see them. The sync is bounded by SYNC_TIMEOUT_S and best effort."""
        drafter, self.drafter = self.drafter, None
        if drafter is not None:
            if sync:
                emitted = self.committed[: len(self.stopper.generated)]  # not what ran past a stop
                rollback, new = self.view.edit(emitted)
                try:
                    self.call(drafter, "propose", self.session, new,
                              Budget(0, 0, deadline=time.monotonic() + SYNC_TIMEOUT_S), rollback,
                              self.feedback(len(emitted)))
                except Exception:  # learning from this session is lost; the request is not
                    pass
            try:
                self.call(drafter, "close", self.session)
            except Exception:  # closing is best effort: the drafter may be gone
                pass

    def call(self, drafter: Drafter, method: str, *args):
        """A drafter call on the worker thread when there is one (keeps calls in order), else here."""
        if self.worker is not None:
            return self.worker.call(method, *args)
        return getattr(drafter, method)(*args)

    def _validate(self, tree: TokenTree, budget: Budget) -> TokenTree:
        return tree.validate(self.engine.verifier.info.vocab_size, budget.max_nodes, budget.max_depth)

    def feedback(self, num_committed: int | None = None) -> DraftFeedback:
        """What goes with the next drafter call: the committed length (prompt + ``num_committed`` tokens,
        default all committed so far) and the feedback not yet sent."""
        verified, self.unsent = tuple(self.unsent), []
        count = len(self.committed) if num_committed is None else num_committed
        return DraftFeedback(self.prompt_len + count, verified)

    def draft_now(self, budget: Budget) -> TokenTree:
        """Draft from the committed context on this thread; an empty tree if the drafter fails."""
        rollback, new = self.view.edit(self.committed)
        try:
            return self._validate(self.drafter.propose(self.session, new, budget, rollback, self.feedback()), budget)
        except Exception as exc:  # a broken drafter must not break the request
            self.fail(exc)
            return TokenTree.empty()

    def start_draft(self, budget: Budget, hypothesis: Sequence[int] = ()):
        """Queue a draft from the committed context + ``hypothesis`` on the worker; a Future."""
        rollback, new = self.view.edit(self.committed, hypothesis)
        return self.worker.propose(self.session, new, budget, rollback, self.feedback())

    def draft_on_worker(self, budget: Budget) -> tuple[TokenTree, float]:
        tree, seconds = self.collect(self.start_draft(budget), budget)
        return (tree if tree is not None else TokenTree.empty()), seconds

    def collect(self, pending, budget: Budget) -> tuple[TokenTree | None, float]:
        """Wait for a queued draft (telling a greedy pre-draft to stop first); (tree or None, drafter seconds)."""
        if self.stop_event is not None:
            if self.greedy:
                self.stop_event.set()
            self.stop_event = None
        if pending is None:
            return None, 0.0
        try:
            tree, seconds = pending.result()
            if self.drafter is None:  # it failed while this draft was queued
                return None, seconds
            return self._validate(tree, budget), seconds
        except Exception as exc:
            self.fail(exc)
            return None, 0.0

    def verify(self, tree: TokenTree) -> tuple[TokenTree, VerifyResult]:
        """Verify ``tree`` and commit the result; a tree the verifier calls malformed drops the drafter."""
        verifier = self.engine.verifier
        try:
            verified = verifier.verify(self.session, tree)
        except InvalidTreeError as exc:
            if self.stop_event is not None:  # stop a pre-draft in flight before closing the drafter
                self.stop_event.set()
            self.fail(InvalidTreeError(str(exc)))
            tree = TokenTree.empty()
            verified = verifier.verify(self.session, tree)
        self.committed += verified.tokens
        if verified.feedback is not None and self.drafter is not None:
            self.unsent = self.unsent[-(MAX_UNSENT_FEEDBACK - 1) :] + [verified.feedback]
        return tree, verified

    def step_stats(self, tree: TokenTree, verified: VerifyResult, budget: Budget, t_step: float, **extra) -> StepStats:
        error, self.error = self.error, ""
        return StepStats(
            num_proposed=tree.num_nodes,
            tree_depth=tree.max_depth,
            num_accepted=verified.num_accepted,
            accepted_sources=tuple(tree.sources[i] for i in verified.accepted_nodes) if tree.sources else (),
            proposed_sources=tree.sources,
            verify_seconds=verified.seconds,
            draft_error=error,
            budget=(budget.max_nodes, budget.max_depth),
            step_seconds=time.perf_counter() - t_step,
            **extra,
        )

    def finish(self) -> None:
        """Stop drafting ahead, close the drafter session and the worker."""
        if self.stop_event is not None:
            self.stop_event.set()
        self.close_drafter(sync=True)
        if self.worker is not None:
            self.worker.shutdown()
