"""The per-request speculation loop: prefill -> (propose -> verify -> commit)* -> stop.

The engine only sees the Drafter and Verifier interfaces; whether they run in
this process, behind gRPC or on Ray is decided by whoever builds the engine.
Plain autoregressive decoding is the same loop with no drafter (empty trees).

A drafter that fails (raises, or returns a tree the verifier rejects as
malformed) never fails the request: the step falls back to plain decoding, the
error is recorded in the step's stats, and the drafter is dropped for the rest
of the request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from drafter_service.drafter import Drafter
from orchestrator.policy import SpeculationPolicy, StaticPolicy
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import StopChecker
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from verifier_service.verifier import Verifier


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
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.policy = policy or StaticPolicy()
        self.decode = decode

    def stream(
        self, prompt: Sequence[int], sampling: SamplingParams, result: GenerationResult | None = None
    ) -> Iterator[StepEvent]:
        """Yield emitted tokens step by step. Pass ``result`` to have it filled in as the stream ends."""
        result = result if result is not None else GenerationResult([], "", RequestStats())
        stats = result.stats
        stats.prompt_tokens = len(prompt)
        stopper = StopChecker(sampling, self.verifier.info.eos_token_ids, self.decode)
        session = uuid.uuid4().hex
        start = time.perf_counter()
        drafter = self.drafter
        try:  # the finally releases the verifier session even when prefill itself fails
            prefill = self.verifier.prefill(session, prompt, sampling)
            stats.prefill_seconds = prefill.seconds
            emitted = stopper.push([prefill.first_token])
            yield StepEvent(tuple(emitted), None)
            open_error = ""
            if drafter is not None:
                try:
                    drafter.open(session, prompt, sampling)
                except Exception as exc:  # an unreachable drafter: decode without it
                    open_error, drafter = f"{type(exc).__name__}: {exc}", self._drop(drafter, session)
            delta = [prefill.first_token]  # committed tokens the drafter has not seen yet
            while not stopper.done:
                budget = self.policy.next_budget(stats, stopper.remaining)
                tree, draft_seconds, error = TokenTree.empty(), 0.0, open_error
                open_error = ""
                if drafter is not None and not budget.is_zero:
                    t0 = time.perf_counter()
                    try:
                        tree = drafter.propose(session, delta, budget)
                        delta = []
                        tree.validate(self.verifier.info.vocab_size, budget.max_nodes, budget.max_depth)
                    except Exception as exc:  # a broken drafter must not break the request
                        error, drafter = f"{type(exc).__name__}: {exc}", self._drop(drafter, session)
                        tree = TokenTree.empty()
                    draft_seconds = time.perf_counter() - t0
                try:
                    verified = self.verifier.verify(session, tree)
                except InvalidTreeError as exc:
                    error, drafter, tree = f"InvalidTreeError: {exc}", self._drop(drafter, session), TokenTree.empty()
                    verified = self.verifier.verify(session, tree)
                step = StepStats(
                    num_proposed=tree.num_nodes,
                    tree_depth=tree.max_depth,
                    num_accepted=verified.num_accepted,
                    accepted_sources=tuple(tree.sources[i] for i in verified.accepted_nodes) if tree.sources else (),
                    proposed_sources=tree.sources,
                    draft_seconds=draft_seconds,
                    verify_seconds=verified.seconds,
                    draft_error=error,
                )
                stats.steps.append(step)
                delta += verified.tokens
                emitted = stopper.push(verified.tokens)
                result.text_limit = stopper.text_limit  # known before the last event goes out
                yield StepEvent(tuple(emitted), step)
        finally:
            self.verifier.release(session)
            self._drop(drafter, session)
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

    @staticmethod
    def _drop(drafter: Drafter | None, session: str) -> None:
        """Close the drafter's session, ignoring its errors; returns None, the drafter to use from now on."""
        if drafter is not None:
            try:
                drafter.close(session)
            except Exception:  # closing is best effort: the drafter may be gone
                pass
        return None

