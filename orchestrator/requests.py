"""What the engine core (orchestrator/core.py) holds and hands out: a request as data, how it speculates, and
where its events go.

- ``Request``: one request's record (status, prompt, sampling, ``Method``, ``StopChecker``, ``DrafterLink``,
  committed tokens, stats, the tree drafted ahead), owned by the core thread.
- ``Method``: drafter candidates, policy, target features, strict, overlap, background drafting.
- ``RequestOutput``: the two callbacks a front end gives (``event`` per step, ``finish`` once), called on the core
  thread; ``QueueOutput`` for a blocking consumer (``embedded.CoreEngine``, the per-request engine's ``stream`` /
  ``generate`` over a core, reads one).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from orchestrator.drafter_link import DrafterCandidate, DrafterLink, PendingDraft
from orchestrator.engine import GenerationResult, StepEvent
from orchestrator.policy import SpeculationPolicy, StaticPolicy
from orchestrator.stats import RequestStats
from orchestrator.stopping import StopChecker
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

if TYPE_CHECKING:
    from verifier_service.lookahead import LookaheadConfig


class Status(Enum):
    WAITING = "waiting"  # submitted, not admitted (no KV blocks yet)
    PREFILLING = "prefilling"  # admitted; prompt chunks still to run
    RUNNING = "running"  # decoding: one tree per step
    PREEMPTED = "preempted"  # decoding, its KV given back to the pool for others' steps: steps again once resumed
    FINISHED = "finished"


@dataclass(frozen=True)
class Method:
    """How a request speculates: its drafter candidates in order of preference (none = plain decoding), the
    policy that sizes each step's tree, what its drafter reads of the verifier's step (per-row options of the
    batch: the target's features for Falcon heads, the top-k after every verified row for token recycling, a
    lookahead window for n-gram learners; None: the verifier's own settings), and ``strict``: a drafter failure
    fails the request instead of failing over (tests, proposer debugging)."""

    drafters: Sequence[DrafterCandidate] = ()
    policy: SpeculationPolicy = field(default_factory=lambda: StaticPolicy(0, 0))
    features: bool = False
    strict: bool = False
    overlap: bool = False  # PEARL: draft the next tree while this step's forward runs (see EngineCore.step)
    # drafter calls run on the drafting pool shared by every request, not inline on the core's thread: remote
    # drafters (their round trips then overlap each other's instead of adding up)
    background: bool = False
    feedback_topk: int | None = None  # the verifier's per-row options (None: its own settings)
    lookahead: LookaheadConfig | None = None


class RequestOutput(Protocol):
    """Where a request's events go. Called on the core thread: must not block."""

    def event(self, event: StepEvent) -> None:
        """Tokens committed (and emitted: stop conditions applied) by the prefill or one step."""

    def finish(self, result: GenerationResult, error: BaseException | None) -> None:
        """The request ended: its result (finish reason "aborted" when cancelled), or the error that ended it."""


@dataclass(eq=False)
class Request:
    """One request as the core holds it."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    method: Method
    output: RequestOutput
    stopper: StopChecker
    result: GenerationResult
    link: DrafterLink
    committed: list[int]  # every token committed after the prompt (the link reads it)
    status: Status = Status.WAITING
    submitted: float = field(default_factory=time.perf_counter)
    retry_empty: bool = False  # the verifier refused the last tree: verify the pending token alone once
    draft_cpu_counted: float = 0.0
    trace: object | None = None  # the request's span (tracing.start_request_span): each step adds a child
    # a remote loop's calls (orchestrator/remote_loop.py): the spans they are sent under, open until answered
    prefill_span: object | None = None
    step_span: object | None = None
    ahead: Predraft | None = None  # overlap: what is being drafted ahead during this step's forward (or is late)
    ahead_stats: dict = field(default_factory=dict)  # the last tree drafted ahead, for the next step's StepStats
    in_step: bool = False  # in a step begun and not ended
    step_started_ns: int | None = None  # when its current step began (its span's start)
    ready: tuple[TokenTree, Budget, float] | None = None  # overlap: next step's tree, drafted ahead (+ seconds)
    predrafted: bool = False  # this step's tree was drafted ahead
    deferred: tuple[TokenTree, Budget, float] | None = None  # the tree of a step it was preempted out of

    @property
    def stats(self) -> RequestStats:
        return self.result.stats


@dataclass(eq=False)
class Predraft:
    """A tree drafted ahead from the first ``base`` committed tokens + ``hypothesis`` (this step's tree's main
    line) while the step's forward runs; or a remote drafter's restart draft that was late for its step
    (no hypothesis), kept until it lands."""

    hypothesis: list[int]
    budget: Budget  # the next tree's budget (the pre-draft itself is one level deeper: predraft_budget)
    stop: threading.Event
    pending: PendingDraft | None = None  # set on the drafting thread
    base: int = 0  # committed tokens in the context it is drafted from (the hypothesis follows them)


# ------------------------------------------------------------------ outputs
_END = object()


class QueueOutput:
    """A blocking consumer's output: ``events()`` yields the request's StepEvents on the consumer's thread
    and raises the error that ended it, if any."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None

    def event(self, event: StepEvent) -> None:
        self._queue.put(event)

    def finish(self, result: GenerationResult, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self._queue.put(_END)

    def events(self) -> Iterator[StepEvent]:
        while (item := self._queue.get()) is not _END:
            yield item
        if self.error is not None:
            raise self.error
