"""A request's link to its drafter: which drafter drafts, what it holds, what happens when it fails.

A request gets its drafter candidates in order of preference (embedded: its one
LocalDrafter; `serve`: the drafter replicas, least-loaded first, then prompt lookup in
its own process). The link

- keeps the drafter's view of the context (``DraftContext``) and turns what the engine
  wants drafted from (the committed tokens, plus a hypothesis when drafting ahead) into
  context edits (rollback, append);
- runs every call to the drafter through one ``DraftWorker``: on a background thread in
  the overlapped (PEARL) loop, so drafting overlaps verification, or at once on the
  engine's thread in the sequential loop; a remote drafter (an ``AsyncDrafter``) is
  handed each call at once in both, and answers through a Future, holding no thread;
- checks every tree against the contract (vocabulary, the step's budget): this is the
  trust boundary between drafter and orchestrator, and no other part of the orchestrator
  checks trees again (the verifier checks what reaches it, its own boundary);
- fails over: when the drafter in use raises (dead, timed out, unreachable) or sends a
  tree that breaks the contract, the failure is recorded for the step's stats, the drafter
  is closed and the next candidate is opened with every committed token; that step is
  verified without a tree and the new drafter drafts from the next step on. With no
  candidate left the request decodes plainly. Drafts never change the output, so none of
  this does;
- hands the verifier's feedback over with the next drafter call, and before closing brings
  the drafter's context to exactly the emitted tokens (a short, best-effort sync), so
  proposers can learn from finished sessions.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from specmesh.contract import Budget, DraftCall, Drafter, common_prefix_len
from specmesh.feedback import DraftFeedback, TargetFeatures, VerifyFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

log = logging.getLogger("specmesh.drafter_link")

DrafterCandidate = tuple[str, Callable[[], Drafter]]  # (name for stats and logs, factory called when needed)
SYNC_TIMEOUT_S = 0.5  # the context sync before a drafter session closes
MAX_UNSENT_FEEDBACK = 16  # verifications' feedback kept for the next drafter call (zero budgets send none)


def only(drafter: Drafter | None, name: str = "drafter") -> list[DrafterCandidate]:
    """The candidates of a request with one drafter and no fallback (none for plain decoding)."""
    return [] if drafter is None else [(name, lambda: drafter)]


@dataclass
class DraftContext:
    """What a drafter session holds, as seen by the engine: the committed tokens up to
    ``mark`` (counted after the prompt), followed by ``tail``, which is either committed
    tokens it has not been told about yet or a hypothesis it drafted ahead on."""

    mark: int = 0
    tail: list[int] = field(default_factory=list)

    def edit(self, committed: Sequence[int], hypothesis: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(rollback, new_tokens) that bring the drafter to ``committed + hypothesis``; records it.
        ``committed`` is every token committed after the prompt."""
        target = list(committed[self.mark :]) + list(hypothesis)
        keep = common_prefix_len(self.tail, target)
        rollback, append = len(self.tail) - keep, target[keep:]
        self.mark, self.tail = len(committed), list(hypothesis)
        return rollback, append


class _SerialQueue:
    """Calls run one at a time, in submission order, on threads of a shared pool: a request's drafting
    overlaps its verification without a thread of its own. (A thread per request cost ``serve`` its
    stack's dirty pages each time, up to glibc's 40 MB cache of freed stacks: +38 MB of RSS in two
    minutes of load, issue 17.)"""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._calls: deque[tuple[Future, contextvars.Context, Callable, tuple]] = deque()
        self._draining = False

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` in a copy of the caller's context: the drafter calls it makes join the caller's
        trace (the span current at submit is their parent)."""
        future: Future = Future()
        context = contextvars.copy_context()
        with self._lock:
            self._calls.append((future, context, fn, args))
            if not self._draining:
                self._draining = True
                self._pool.submit(self._drain)
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._draining = False
                    return
                future, context, fn, args = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(context.run(fn, *args))
                except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                    future.set_exception(exc)


_DRAFT_THREADS: ThreadPoolExecutor | None = None  # created on first use, shared by every background worker
_DRAFT_THREADS_LOCK = threading.Lock()
MAX_DRAFT_THREADS = 64  # background drafting calls running at once in this process (more wait their turn)


def _draft_threads() -> ThreadPoolExecutor:
    global _DRAFT_THREADS
    with _DRAFT_THREADS_LOCK:
        if _DRAFT_THREADS is None:
            _DRAFT_THREADS = ThreadPoolExecutor(MAX_DRAFT_THREADS, thread_name_prefix="draft-worker")
        return _DRAFT_THREADS


class DraftWorker:
    """Runs calls to drafters in submission order, each answered by a Future: in the background
    (``background``: drafting overlaps the caller's work; on a thread of a pool shared by every request),
    or at once on the caller's thread. A drafter is never called from two threads at once. An
    ``AsyncDrafter`` (a replica's) is called at once in either case: its calls only hand work off, in order,
    so a request waiting for a remote drafter holds no thread."""

    def __init__(self, background: bool) -> None:
        self._queue = _SerialQueue(_draft_threads()) if background else None
        # CPU time this process's threads spent in the drafter's calls (its own work when it runs in this
        # process, ~0 for a remote one): what drafting costs cores shared with an in-process verifier
        self.cpu_seconds = 0.0

    def open(self, drafter: Drafter, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
             prompt_len: int | None = None) -> Future:
        return self._submit(drafter, drafter.open, session_id, list(prompt), sampling, prompt_len)

    def propose(self, drafter: Drafter, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int,
                feedback: DraftFeedback | None) -> Future:
        """Future of (tree, seconds the drafter worked on it)."""
        if _hands_off(drafter):
            return _timed(drafter.propose_async(session_id, new_tokens, budget, rollback, feedback))

        def timed() -> tuple[TokenTree, float]:
            t0, c0 = time.perf_counter(), time.thread_time()
            tree = drafter.propose(session_id, new_tokens, budget, rollback, feedback)
            self.cpu_seconds += time.thread_time() - c0
            return tree, time.perf_counter() - t0

        return self._submit(drafter, timed)

    def close(self, drafter: Drafter, session_id: str) -> Future:
        return self._submit(drafter, drafter.close, session_id)

    def _submit(self, drafter: Drafter, fn: Callable, *args) -> Future:
        if self._queue is not None and not _hands_off(drafter):
            return self._queue.submit(fn, *args)
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future


def _hands_off(drafter: Drafter) -> bool:
    """Whether ``drafter`` is an ``AsyncDrafter`` (its calls return at once, in order)."""
    return hasattr(drafter, "propose_async")


def _timed(tree: Future) -> Future:
    """Future of (tree, seconds from now until ``tree`` resolved)."""
    t0 = time.perf_counter()
    timed: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            timed.set_exception(exc)
        else:
            timed.set_result((f.result(), time.perf_counter() - t0))

    tree.add_done_callback(done)
    return timed


@dataclass
class _InUse:
    name: str
    drafter: Drafter
    opening: Future  # its open(); a failed open explains why its proposals fail


@dataclass
class PendingDraft:
    """A draft asked of the drafter in use; ``collect`` it."""

    future: Future  # (tree, seconds)
    budget: Budget
    asked: _InUse  # the drafter asked: its answer is dropped if it was failed over meanwhile


class DrafterLink:
    """One request's drafter. ``committed`` is the request's list of tokens committed after the prompt
    (the engine appends to it; the link only reads it)."""

    def __init__(self, candidates: Sequence[DrafterCandidate], session_id: str, vocab_size: int,
                 committed: list[int], background: bool, strict: bool = False) -> None:
        """``strict``: a drafter failure is raised instead of failed over (a proposer bug then fails the
        request rather than hiding behind plain decoding: tests, debugging a proposer)."""
        self.candidates = list(candidates)
        self.strict = strict
        self.session_id = session_id
        self.vocab_size = vocab_size
        self.committed = committed
        self.worker = DraftWorker(background)
        self.view = DraftContext()
        self._next = 0  # next candidate to try
        self._in_use: _InUse | None = None
        self._prompt: list[int] = []
        self._sampling = SamplingParams()
        self._errors: list[str] = []  # failures not yet reported in a step
        self._unsent: list[VerifyFeedback] = []  # verifier feedback not yet given to the drafter
        self._unsent_features: list[TargetFeatures] = []  # target features not yet given (never dropped)
        self._stop: threading.Event | None = None  # ends the pre-draft in flight

    @property
    def active(self) -> bool:
        """A drafter is in use (False once every candidate failed, or with none)."""
        return self._in_use is not None

    @property
    def drafter_name(self) -> str:
        """The candidate in use ("" = none)."""
        return self._in_use.name if self._in_use is not None else ""

    # ------------------------------------------------------------ lifetime
    def open(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """Start opening the first candidate that opens (on the worker; see ``wait_open``)."""
        self._prompt, self._sampling = list(prompt), sampling
        self._open_next()

    def wait_open(self) -> None:
        """Wait for the drafter in use to be open; a failure there fails over."""
        if self._in_use is not None:
            try:
                self._in_use.opening.result()
            except Exception as exc:
                self.fail(exc)

    def close(self, num_emitted: int, wait: bool = True) -> None:
        """Stop drafting ahead, close the drafter in use and the worker. Before closing, the drafter's context
        is brought to exactly the first ``num_emitted`` committed tokens (a stop may cut the last step), with
        the last feedback, so proposers that learn from finished sessions see them (bounded by SYNC_TIMEOUT_S,
        best effort). ``wait=False`` (a background worker): both calls are queued on the worker, in that order,
        and the caller goes on (an engine core's loop must not wait for a remote drafter)."""
        self._stop_predraft()
        in_use, self._in_use = self._in_use, None
        if in_use is not None:
            emitted = self.committed[:num_emitted]
            rollback, new = self.view.edit(emitted)
            budget = Budget(0, 0, deadline=time.monotonic() + SYNC_TIMEOUT_S)
            sync = self.worker.propose(in_use.drafter, self.session_id, new, budget, rollback,
                                       self._feedback(len(emitted)))
            closing = self.worker.close(in_use.drafter, self.session_id)
            if not wait:
                return
            try:
                sync.result()
            except Exception as exc:  # learning from this session is lost; the request is not
                log.debug("context sync before close failed: %s: %s", type(exc).__name__, exc)
            try:
                closing.result()
            except Exception:  # closing is best effort: the drafter may be gone
                pass

    # ------------------------------------------------------------ drafting
    def start(self, budget: Budget, hypothesis: Sequence[int] = (), stop: threading.Event | None = None
              ) -> PendingDraft | None:
        """Ask for a tree drafted from the committed tokens + ``hypothesis``; None without a drafter.
        ``stop``: the event that ends a pre-draft early (set by ``collect`` for greedy requests)."""
        prepared = self.prepare(budget, hypothesis, stop)
        if prepared is None:
            return None
        call, asked = prepared
        future = self.worker.propose(asked.drafter, call.session_id, call.new_tokens, budget, call.rollback,
                                     call.feedback)
        return PendingDraft(future, budget, asked)

    def prepare(self, budget: Budget, hypothesis: Sequence[int] = (), stop: threading.Event | None = None
                ) -> tuple[DraftCall, _InUse] | None:
        """``start``'s call as data, not sent: for a host that sends the calls of many requests to one drafter
        at once (``LocalDrafter.propose_many``) and hands each answer back with ``answered``. None without a
        drafter. The context edit is recorded as sent."""
        if self._in_use is None:
            return None
        rollback, new = self.view.edit(self.committed, hypothesis)
        self._stop = stop
        return DraftCall(self.session_id, new, budget, rollback, self._feedback()), self._in_use

    def answered(self, asked: _InUse, budget: Budget, outcome: TokenTree | Exception, seconds: float,
                 cpu_seconds: float = 0.0) -> PendingDraft:
        """A prepared call's answer, as the PendingDraft ``collect`` takes (``cpu_seconds``: this request's share
        of the drafting CPU time)."""
        future: Future = Future()
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result((outcome, seconds))
        self.worker.cpu_seconds += cpu_seconds
        return PendingDraft(future, budget, asked)

    @property
    def drafter(self) -> Drafter | None:
        """The drafter in use (None: none)."""
        return self._in_use.drafter if self._in_use is not None else None

    def collect(self, pending: PendingDraft | None) -> tuple[TokenTree | None, float]:
        """(tree, drafter seconds) of a draft asked with ``start``; (None, ...) when there is none or it
        failed (the failure is recorded and the next candidate opened). A greedy pre-draft is told to
        stop first: the tree it has by then is as good as any (drafts never change greedy output)."""
        if self._sampling.greedy:
            self._stop_predraft()
        self._stop = None
        if pending is None:
            return None, 0.0
        try:
            tree, seconds = pending.future.result()
        except Exception as exc:
            if pending.asked is self._in_use:
                opening = pending.asked.opening
                self.fail(opening.exception() if opening.done() and opening.exception() else exc)
            return None, 0.0
        if pending.asked is not self._in_use:  # failed over while it was queued
            return None, seconds
        try:
            return tree.validate(self.vocab_size, pending.budget.max_nodes, pending.budget.max_depth), seconds
        except Exception as exc:
            self.fail(exc)
            return None, seconds

    def draft(self, budget: Budget, hypothesis: Sequence[int] = ()) -> tuple[TokenTree, float]:
        """``start`` and ``collect`` at once; an empty tree when there is none."""
        tree, seconds = self.collect(self.start(budget, hypothesis))
        return (tree if tree is not None else TokenTree.empty()), seconds

    # ------------------------------------------------------------ feedback and failures
    def add_feedback(self, feedback: VerifyFeedback) -> None:
        """Feedback of one verification, for the next drafter call (the newest MAX_UNSENT_FEEDBACK kept)."""
        if self._in_use is not None:
            self._unsent = self._unsent[-(MAX_UNSENT_FEEDBACK - 1):] + [feedback]

    def add_features(self, features: TargetFeatures) -> None:
        """Target features (a prefill's, a verification's) for the next drafter call. Kept whole, even before the
        drafter opens: a feature-based drafter needs every committed position's (bounded by the request)."""
        self._unsent_features.append(features)

    def fail(self, exc: BaseException) -> None:
        """The drafter in use failed: record it, close it, open the next candidate with every committed
        token (or decode without drafts when none is left)."""
        self._stop_predraft()
        if self.strict:
            raise exc
        in_use, self._in_use = self._in_use, None
        if in_use is None:
            return
        self._record(in_use.name, exc)
        self.worker.close(in_use.drafter, self.session_id)  # best effort: it may be the one that died
        self._open_next()

    def take_errors(self) -> str:
        """The failures since the last call, for the step's stats ("" if none)."""
        if not self._errors:
            return ""
        errors, self._errors = self._errors, []
        return "; ".join(errors)

    # ------------------------------------------------------------ internals
    def _feedback(self, num_committed: int | None = None) -> DraftFeedback:
        """What goes with a drafter call: the committed length (prompt + ``num_committed`` tokens, default
        all committed so far) and the feedback not yet sent. Target features only of positions inside that
        context: a drafter refuses rows past it (a stop may cut the last step's accepted rows)."""
        verified, self._unsent = tuple(self._unsent), []
        count = len(self.committed) if num_committed is None else num_committed
        length = len(self._prompt) + count
        features = tuple(f if f.start + len(f) <= length else TargetFeatures(f.start, f.rows[: length - f.start])
                         for f in self._unsent_features if f.start < length)
        self._unsent_features = []
        return DraftFeedback(length, verified, features)

    def _open_next(self) -> None:
        """Open the next candidate that opens: on the worker, with the prompt and every committed token."""
        while self._next < len(self.candidates):
            name, factory = self.candidates[self._next]
            self._next += 1
            try:
                drafter = factory()
                opening = self.worker.open(drafter, self.session_id, self._prompt + self.committed, self._sampling,
                                           len(self._prompt))
            except Exception as exc:
                self._record(name, exc)
                continue
            if opening.done() and opening.exception() is not None:  # opened at once, and failed
                self._record(name, opening.exception())
                continue
            self._in_use = _InUse(name, drafter, opening)
            self.view = DraftContext(mark=len(self.committed))
            return
        if self.candidates:  # every one failed, each recorded above
            self._errors.append("no drafter left: decoding without drafts")

    def _record(self, name: str, exc: BaseException) -> None:
        message = f"{name}: {type(exc).__name__}: {exc}"
        log.warning("session %s: drafter failed (%s); failing over", self.session_id, message)
        self._errors.append(message)

    def _stop_predraft(self) -> None:
        if self._stop is not None:
            self._stop.set()
