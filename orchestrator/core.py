"""The engine core: every request of one verifier (in process, or a replica over gRPC), stepped by one loop on
one thread.

Requests are data, not threads (vLLM V1's EngineCore, SGLang's scheduler). A front end
``submit``s a request with a ``RequestOutput`` (where its events go: a thread-safe queue for
a blocking consumer, ``call_soon_threadsafe`` into an asyncio queue for a server) and may
``cancel`` it by id; the loop's thread does everything else.

In process the core owns its loop: one thread runs ``EngineCore.step``, which only calls down:

    EngineCore.begin_step   every running request's tree (drafted now, or ahead during the last step): proposers
    -> Scheduler.schedule   the trees, prompt chunks within the token budget, room in the KV pool (preemption)
    -> Scheduler.launch     one target forward over all of them, acceptance for the whole batch, queued
       EngineCore.launch    (PEARL) the next trees drafted ahead while the device runs
    -> Scheduler.finish     the one host copy back: a StepOutput (results, finished prefills, resumed sessions)
    -> EngineCore.end_step  commit, stream and stop checks per request; then the prefills that finished start
                            decoding

The ``Scheduler`` (verifier_service/scheduler.py) owns the request table's KV side: admission, chunked prefill,
preemption, the prefix cache; the same class serves a verifier replica's gRPC callers (``StepLoop``). Over a
replica the core is driven by a ``RemoteStepLoop`` (orchestrator/remote_loop.py: the same step with the forward
one VerifyBatch call to the replica; several may be out at once).

A request's drafter is its ``DrafterLink`` (drafter_link.py) run inline on the loop's thread: the
same context edits, tree checks, feedback hand-over and failover as the per-request engine
(engine.py), so a request's tokens are the same whether it runs alone or in a batch, and
greedy output equals plain decoding. Plain decoding is a request without a drafter: an empty
tree every step, sharing every line with speculation.

PEARL is scheduling (``Method.overlap``): while a step's forward runs, the core's drafting thread
drafts every overlapping request's next tree on the assumption that this step's main line is
accepted; the part of it below what was committed is the next step's tree, and a request whose
pre-draft did not hold verifies its pending token alone (restart depth 0) while drafting ahead
again. A remote drafter's tree is never waited for (``late``): its request sits out until the tree lands while
the others step (a remote loop may have several steps out: ``begin_step`` / ``end_step``). See
docs/ARCHITECTURE.md, "The engine core".
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.drafter_link import DrafterLink, PendingDraft
from orchestrator.engine import GenerationResult, StepEvent, emitted_logprobs
from orchestrator.overlap import predraft_budget, reusable_subtree
from orchestrator.policy import MethodSteps, reads_ranks
from orchestrator.remote_loop import RemoteStepLoop
from orchestrator.requests import Method, Predraft, Request, RequestOutput, Status
from orchestrator.stats import RequestStats, StepStats
from orchestrator.stopping import StopChecker
from orchestrator.tracing_steps import PREFILL_SPAN, STEP_SPAN, step_attributes, step_start_attributes
from specmesh import tracing
from specmesh.contract import (
    Budget,
    PrefillResult,
    SessionPreemptedError,
    TokenLogprobs,
    VerifyCosts,
    VerifyResult,
)
from specmesh.feedback import TargetFeatures
from specmesh.host_runtime import close_at_exit
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from verifier_service.arguments import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAITING
from verifier_service.remote import VerifierClient
from verifier_service.scheduler import Scheduler, Session

if TYPE_CHECKING:  # torch: `serve` over replicas runs no model and never imports it
    from verifier_service.verifier import LocalVerifier

log = logging.getLogger("specmesh.core")
EMPTY_TREE = TokenTree.empty()  # every plain step's tree: one shared instance (its derived arrays computed once)
PLAIN = (EMPTY_TREE, Budget(0, 0), 0.0)  # (tree, budget, draft seconds) of a request without a drafter
MAX_METHOD_POOLS = 64  # methods whose steps a core pools at once (``method_steps``)
PREEMPTED_RETRY_S = 0.005  # a replica preempted a request's session: its tree is sent again after this


class EngineCore:
    """Every request of one verifier, stepped by the core's own loop (in process: ``step``) or by a
    ``RemoteStepLoop`` (a replica) whose driver this is (see module doc).
    Thread-safe: ``submit`` / ``cancel`` / ``close`` from any thread; everything else runs on the loop's."""

    def __init__(self, verifier: LocalVerifier | VerifierClient, decode: Callable[[list[int]], str] | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_waiting: int = DEFAULT_MAX_WAITING,
                 costs: VerifyCosts | None = None, name: str = "engine-core") -> None:
        """``verifier``: the target in this process (the core's loop steps it), or a verifier replica whose
        ``fetch_info`` succeeded (a ``RemoteStepLoop`` sends it the steps: orchestrator/remote_loop.py).
        ``decode``: token ids -> text, for stop strings; ``max_batch_tokens``: rows of one forward (prompt
        chunks fill what the running requests leave); ``max_waiting``: requests waiting for KV blocks before
        the next is refused (both: in process; a replica has its own); ``costs``: the forward's measured costs,
        for load-aware policies (in process: refitted to the loop's own steps, ``StepCosts``; a replica's: what it
        reported)."""
        self.verifier = verifier
        self.info = verifier.info
        self.decode = decode
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # every unfinished request (submitters add, the loop removes)
        self._running: dict[str, Request] = {}  # decoding; the loop thread's
        self._steps: set[Step] = set()  # every step begun and not ended (a remote loop may have several out)
        self._drafting: ThreadPoolExecutor | None = None  # overlap: drafts ahead while a forward runs
        self._method_steps: dict[Hashable, MethodSteps] = {}  # per method: its requests' steps, pooled
        self.remote: RemoteStepLoop | None = None
        self.scheduler: Scheduler | None = None
        if isinstance(verifier, VerifierClient):
            self.costs = costs or verifier.costs
            self.remote = RemoteStepLoop(verifier, self, name)
            self.stats = self.remote.stats
        else:
            self.scheduler = Scheduler(verifier, max_batch_tokens, max_waiting, costs)
            self.costs = self.scheduler.costs  # refitted to the steps as they run (``StepCosts``)
            self.stats = self.scheduler.stats  # what /metrics and benchmarks read (VerifierMetrics)
            self._cond = self.scheduler.cond  # one lock for the table and the loop's queue
            self._soon: list[Callable[[], None]] = []  # ``call_soon``
            self._closed = False
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
            close_at_exit(self)  # joined before the interpreter finalizes (specmesh/host_runtime.py, "Exit")

    # --------------------------------------------------------------- front end
    def submit(self, prompt: Sequence[int], sampling: SamplingParams, method: Method, output: RequestOutput,
               request_id: str | None = None, trace=None) -> str:
        """Queue a request; its events go to ``output``. Returns its id (for ``cancel``). A request that can
        never run raises here: ValueError (bad input), CapacityError (larger than the whole KV pool, or too many
        waiting), RuntimeError (closed). ``trace``: the request's span; every step of it is recorded as a child
        span."""
        prompt = [int(t) for t in prompt]
        request_id = request_id or uuid.uuid4().hex
        committed: list[int] = []
        link = DrafterLink(method.drafters, request_id, self.info.vocab_size, committed,
                           background=method.background, strict=method.strict)
        stats = RequestStats(prompt_tokens=len(prompt), acceptance=sampling.acceptance)
        request = Request(request_id, prompt, sampling, method, output,
                          StopChecker(sampling, self.info.eos_token_ids, self.decode),
                          GenerationResult([], "", stats), link, committed, trace=trace)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already exists")
            self._requests[request_id] = request  # before open: the loop may admit it at once
        try:
            if self.remote is not None:
                self.remote.open(request_id, prompt, sampling, _Admission(self, request), method.features,
                                 method.feedback_topk, method.lookahead)
            else:
                grammar = self.scheduler.verifier.compile_grammar(sampling)  # on a worker, this thread waits
                with self._cond:
                    self._check_open()
                    self.scheduler.add(Session(request_id, prompt, sampling, method.features, method.feedback_topk,
                                               method.lookahead, grammar=grammar))
        except BaseException:
            with self._lock:
                self._requests.pop(request_id, None)
            raise
        return request_id

    def cancel(self, request_id: str) -> None:
        """End a request at the next step (its output gets ``finish`` with reason "aborted"); no-op if unknown."""
        try:
            self.call_soon(lambda: self._cancel(request_id))
        except RuntimeError:  # closed: every request has ended
            pass

    def close(self) -> None:
        """Stop the loop; unfinished requests end with RuntimeError."""
        if self.remote is not None:
            self.remote.close()
            return
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread before its next step (a cancel); RuntimeError once closed."""
        if self.remote is not None:
            self.remote.call_soon(fn)
            return
        with self._cond:
            self._check_open()
            self._soon.append(fn)
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self.remote.alive if self.remote is not None else self._thread.is_alive()

    @property
    def num_sessions(self) -> int:
        """Unfinished requests (waiting included), as a verifier's sessions for /metrics."""
        return (self.remote or self.scheduler).num_sessions

    @property
    def num_waiting(self) -> int:
        return (self.remote or self.scheduler).num_waiting

    @property
    def num_preempted(self) -> int:
        """Requests holding no KV blocks until they resume (in process; a replica reports its own)."""
        return self.scheduler.num_preempted if self.scheduler is not None else 0

    @property
    def num_running(self) -> int:
        """Requests decoding (the batch the next step verifies, less any sitting it out)."""
        return len(self._running)

    def method_steps(self, method: Hashable) -> MethodSteps:
        """The pooled steps of the requests of ``method`` (a key naming a proposer and its budget) on this core,
        for their load-aware policies (``load_aware(..., pooled=)``), created on first use. The core keeps the
        ``MAX_METHOD_POOLS`` most recently used (budgets come from requests: their variety is the clients'); a
        policy holding an older one still reads and feeds it, unshared."""
        with self._lock:
            pooled = self._method_steps.pop(method, None)
            if pooled is None:
                pooled = MethodSteps(lambda: self.num_running)
                if len(self._method_steps) >= MAX_METHOD_POOLS:
                    del self._method_steps[next(iter(self._method_steps))]  # the least recently used
            self._method_steps[method] = pooled  # (last in order: the most recently used)
            return pooled

    def traced(self, request_id: str, call: str):
        """A context manager making current the span a remote loop's call for the request belongs under, so the
        gRPC call's span joins the request's trace: "prefill" opens the request's prefill span (ended when the
        first token commits), "verify" its step span (ended at the step's commit), "release" the request's own.
        Nothing while the request is not traced (on the loop thread)."""
        request = self._requests.get(request_id)
        if request is None or request.trace is None or not request.trace.is_recording():
            return tracing.use(None)
        if call == "prefill":
            request.prefill_span = tracing.start_child(request.trace, PREFILL_SPAN, {
                "specmesh.session.id": request_id, "specmesh.prefill.prompt_tokens": len(request.prompt)})
            return tracing.use(request.prefill_span)
        if call == "verify":
            request.step_span = tracing.start_child(request.trace, STEP_SPAN, start_ns=request.step_started_ns)
            return tracing.use(request.step_span)
        return tracing.use(request.trace)

    def _cancel(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            request.stopper.finish_reason = request.stopper.finish_reason or "aborted"
            self._finish(request)

    # --------------------------------------------------------------- the loop (in process)
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine core is closed")

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # a bug here must not leave every request hanging: end them
                log.exception("engine core step failed")
                self.stop(exc)

    def _iterate(self) -> bool:
        """Wait for work, run the queued calls (cancels), admit, ``step``; False once closed."""
        with self._cond:
            while not (self._closed or self._soon or self.pending() or self.scheduler.has_work()):
                self._cond.wait()
            if self._closed:
                self.stop(RuntimeError("the engine core is closed"))
                return False
            soon, self._soon = self._soon, []
        for fn in soon:
            fn()
        self._admit()
        self.step()
        return True

    def step(self) -> None:
        """One engine step: schedule -> propose -> execute -> update (see module doc)."""
        step = self.begin_step(launch=not getattr(self.verifier, "asynchronous", False))
        batch = self.scheduler.schedule(step.verifies if step is not None else [])
        if batch is None:
            return
        for request_id in batch.paused:  # preempted for this step's blocks: not stepped until it resumes
            self._preempted(request_id)
        self.scheduler.launch(batch)
        if step is not None:  # on a GPU the forward is queued: the next trees are drafted while it runs
            self.launch(step)
        out = self.scheduler.finish(batch)
        if step is not None:
            self.end_step(step, out.results)
        for session, outcome in out.prefilled:
            request = self._requests.get(session.session_id)
            if request is None:
                continue
            if isinstance(outcome, Exception):
                self._finish(request, outcome)
            else:
                self._start_decoding(request, outcome.first_token, outcome.seconds, outcome.features,
                                     outcome.logprobs)
        for request_id in out.resumed:
            self._resumed(request_id)

    def _admit(self) -> None:
        """The scheduler's admissions: an admitted request opens its drafter while its prompt prefills."""
        admissions = self.scheduler.admit()
        for request_id in admissions.resumed:
            self._resumed(request_id)
        for session, exc in admissions.refused:
            request = self._requests.get(session.session_id)
            if request is not None:
                self._finish(request, exc)
        for session in admissions.admitted:
            request = self._requests.get(session.session_id)
            if request is None or not self._opened(request):  # gone meanwhile: its blocks go back
                self.scheduler.remove(session.session_id)

    def _opened(self, request: Request) -> bool:
        """KV reserved: open the drafter (inline: the proposer's prepare runs here) while the prompt prefills;
        False if it failed (the request ended)."""
        if request.status is Status.FINISHED:
            return False
        request.status = Status.PREFILLING
        try:
            with tracing.use(request.trace):
                request.link.open(request.prompt, request.sampling)  # a remote drafter's stream: in the trace
            if not request.method.background:  # a background open's failure shows at its first draft instead
                request.link.wait_open()  # a drafter that fails to open is failed over (strict: raises)
        except Exception as exc:
            self._finish(request, exc)
            return False
        return True

    def _preempted(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and request.status is Status.RUNNING:
            request.status = Status.PREEMPTED

    def _resumed(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            _resume(request)

    # --------------------------------------------------------------- the step's halves
    def pending(self) -> bool:
        """Whether a running request can step now: not in a step already, and not waiting for a remote drafter's
        tree (``late``)."""
        return any(_can_step(r) for r in self._running.values())

    def begin_step(self, launch: bool = True) -> Step | None:
        """Every running request that can step (``pending``), with its tree; (overlap) their next trees planned,
        drafted ahead on the drafting thread while the forward runs: from here, or (``launch`` False) from
        ``launch``, once the forward is on the device. None when none can. A remote loop may have several
        steps out at once, each of other requests: a request whose remote drafter is late waits for its tree
        without holding the others (``late``)."""
        started, started_ns = time.perf_counter(), time.time_ns()
        running, drafts = self._draft_all()  # the requests that step and their (tree, budget, draft seconds)
        if not running:
            return None
        jobs = self._plan_predrafts(running, drafts)  # next trees, on this step's main lines
        for request in running:
            request.in_step = True
            request.step_started_ns = started_ns
        step = Step(running, drafts, started, started_ns, jobs)
        self._steps.add(step)
        if launch:
            self.launch(step)
        return step

    def launch(self, step: Step) -> None:
        """Start the drafting thread on ``step``'s pre-drafts (once; nothing if none)."""
        jobs, step.jobs = step.jobs, []
        if not jobs:
            return
        if self._drafting is None:
            self._drafting = ThreadPoolExecutor(1, thread_name_prefix="core-drafting")
        step.ahead = self._drafting.submit(_draft_ahead, jobs)

    def end_step(self, step: Step, results: Sequence[VerifyResult | Exception]) -> None:
        """After the forward: per request of ``step``, commit, feedback, stream, stop checks."""
        self._steps.discard(step)
        self._join_predrafts(step)
        for request, (tree, budget, draft_seconds), result in zip(step.requests, step.drafts, results, strict=True):
            request.in_step = False
            if request.status is not Status.FINISHED:  # (a remote step's request may end while it is out)
                self._commit(request, tree, budget, result, step.started, draft_seconds, step.started_ns)

    def stop(self, exc: BaseException) -> None:
        """End every request with ``exc`` (the loop closes, or a step failed on a bug)."""
        for step in list(self._steps):  # failed between draft and commit: the drafting thread may still run
            self._join_predrafts(step)
        self._steps.clear()
        with self._lock:
            requests = list(self._requests.values())
        for request in requests:
            self._finish(request, exc)
        if self._drafting is not None:
            self._drafting.shutdown(wait=True)
            self._drafting = None

    def _draft_all(self) -> tuple[list[Request], list[tuple[TokenTree, Budget, float]]]:
        """Every running request that can step, with its tree: the one drafted ahead if usable (overlap), else
        what its policy's budget asks of its drafter now ("restart" with overlap: with restart depth 0, nothing:
        the pending token is verified alone while the next tree is drafted ahead). Requests on one in-process
        drafter are drafted in one call (``draft_batch``). A remote drafter's tree that is not back yet is not
        waited for: its request sits this step out and steps once the tree lands (``late``). A drafter failure
        fails over inside the link; a strict request's failure ends that request alone."""
        running, drafts, asking = [], [], []
        for request in list(self._running.values()):
            if not _can_step(request):
                continue
            if request.deferred is not None:  # preempted out of its last step: the same tree, as if it had run
                drafts.append(request.deferred)
                request.deferred = None
                running.append(request)
                continue
            landed = request.ahead  # a remote drafter's tree that was late, landed now
            try:
                if landed is not None and not landed.hypothesis and landed.base == len(request.committed):
                    # a draft for exactly this context: the step it was late for, as if it had been waited for
                    request.ahead = None
                    tree, seconds = request.link.collect(landed.pending)
                    request.predrafted = False
                    drafts.append((tree if tree is not None else EMPTY_TREE, landed.budget, seconds))
                    running.append(request)
                    continue
                if landed is not None:  # drafted ahead: what applies of it becomes request.ready
                    self._take_predraft(request)
            except Exception as exc:  # strict: the drafter's failure ends its request
                self._finish(request, exc)
                continue
            request.predrafted = request.ready is not None
            if request.ready is not None:
                drafts.append(request.ready)
                request.ready = None
            elif not request.link.active:  # plain decoding (or no drafter left): no budget to ask for
                drafts.append(PLAIN)
            else:
                phase = "restart" if request.method.overlap else "sequential"
                budget = request.method.policy.next_budget(request.stats, request.stopper.remaining, phase)
                drafts.append((EMPTY_TREE, budget, 0.0))
                if request.retry_empty or budget.is_zero:
                    request.retry_empty = False
                else:
                    asking.append((len(running), request, budget))
            running.append(request)
        pendings = draft_batch([(request, budget, [], None) for _, request, budget in asking])
        skip = set()
        for (index, request, budget), pending in zip(asking, pendings, strict=True):
            if late(request, pending):  # steps once it lands (its tree then drafts from exactly this context)
                request.ahead = Predraft([], budget, threading.Event(), pending, len(request.committed))
                pending.future.add_done_callback(self._landed)
                skip.add(index)
                continue
            try:
                tree, seconds = request.link.collect(pending)
            except Exception as exc:  # strict: the drafter's failure ends its request
                self._finish(request, exc)
                skip.add(index)
                continue
            drafts[index] = (tree if tree is not None else EMPTY_TREE, budget, seconds)
        if skip:
            keep = [i for i in range(len(running)) if i not in skip]
            running, drafts = [running[i] for i in keep], [drafts[i] for i in keep]
        return running, drafts

    def _landed(self, _future: Future) -> None:
        """A late remote tree landed (on a drafting thread): have the loop look at its request again."""
        try:
            self.call_soon(_nothing)
        except RuntimeError:  # closed meanwhile
            pass

    # ------------------------------------------------------------ PEARL overlap
    def _plan_predrafts(self, running: list[Request], drafts) -> list[Request]:
        """The requests whose next tree the drafting thread drafts ahead (``launch``), from its committed tokens +
        this step's tree's main line (one call for all of them; the links run inline there). Only that thread
        touches those requests' links until ``_join_predrafts``. A background link's request (a remote drafter)
        is asked from here: its call runs on the drafting pool, and one hop fewer is ~0.1 ms a step."""
        jobs = []
        for request, (tree, _, _) in zip(running, drafts, strict=True):
            if not (request.method.overlap and request.link.active) or request.ahead is not None:
                continue
            path = tree.main_path()
            budget = request.method.policy.next_budget(request.stats, request.stopper.remaining - len(path) - 1,
                                                       "predraft")
            if budget.is_zero:
                continue
            hypothesis = tree.tokens[path].tolist()
            request.ahead = Predraft(hypothesis, budget, threading.Event(), base=len(request.committed))
            jobs.append(request)
        # a background link's calls run on the drafting pool: asking it here does not hold the step up
        inline = [r for r in jobs if r.method.background]
        if inline:
            _draft_ahead(inline)
        return [r for r in jobs if not r.method.background]

    def _join_predrafts(self, step: Step) -> None:
        """The step's forward is over: a greedy request's pre-draft stops where it is (its contents never change
        greedy output); a sampled one runs to its budget (a seed then reproduces). Waits for the drafting thread.
        Pre-drafts never launched (the forward failed before ``launch``) start now."""
        self.launch(step)
        for request in step.requests:
            if request.ahead is not None and request.sampling.greedy:
                request.ahead.stop.set()
        if step.ahead is not None:
            step.ahead.result()

    def _take_predraft(self, request: Request) -> None:
        """Collect the request's tree drafted ahead (after its step committed): the part that drafts past what was
        committed since it was asked becomes its next tree. A remote drafter's that has not landed is left out
        (``late``): the request steps again once it lands (``_draft_all`` takes it then). Its statistics wait in
        ``request.ahead_stats`` for the next step that commits."""
        predraft = request.ahead
        if predraft is None:
            return
        if late(request, predraft.pending):  # the loop looks at the request again once it lands
            predraft.pending.future.add_done_callback(self._landed)
            return
        request.ahead = None
        tree, seconds = request.link.collect(predraft.pending) if predraft.pending is not None else (None, 0.0)
        since = request.committed[predraft.base:]  # committed after the context it was drafted from
        ready = None
        if tree is not None:
            ready = reusable_subtree(tree, predraft.hypothesis, since, predraft.budget.max_nodes)
        if ready is not None:
            request.ready = (ready, predraft.budget, seconds)
        n = len(predraft.hypothesis)
        request.ahead_stats = dict(
            predraft_nodes=tree.num_nodes if tree is not None else 0,
            predraft_used=ready.num_nodes if ready is not None else 0,
            predraft_levels=tree.max_depth if tree is not None else 0, predraft_seconds=seconds,
            ahead_confirmed=tree is not None and len(since) > n and since[:n] == predraft.hypothesis)

    # ------------------------------------------------------------ commit
    def _start_decoding(self, request: Request, first: int, seconds: float, features: TargetFeatures | None,
                        logprobs: TokenLogprobs | None = None) -> None:
        """The prefill finished: commit the first token and hand the prompt's features to the drafter."""
        request.status = Status.RUNNING
        self._running[request.request_id] = request
        if request.prefill_span is not None:
            request.prefill_span.end()
            request.prefill_span = None
        request.stats.prefill_seconds = seconds
        if features is not None:
            request.link.add_features(features)
        request.committed.append(first)
        emitted = request.stopper.push([first])
        request.output.event(StepEvent(tuple(emitted), None, request.stopper.text_limit,
                                       emitted_logprobs(logprobs, len(emitted))))
        if request.stopper.done:
            self._finish(request)

    def _commit(self, request: Request, tree: TokenTree, budget: Budget, result: VerifyResult | Exception,
                step_started: float, draft_seconds: float, started_ns: int) -> None:
        """A verification's outcome: commit its tokens, hand feedback to the drafter, take the tree drafted ahead,
        stream, check stops."""
        if isinstance(result, SessionPreemptedError):  # its KV went back to the pool before the forward: the same
            # tree steps once it resumes (its drafter asked nothing new, so a seeded request's tokens do not change)
            request.deferred = (tree, budget, draft_seconds)
            if self.remote is not None:  # the replica's: sent again a little later (it resumes there)
                request.status = Status.PREEMPTED
                self.remote.call_later(PREEMPTED_RETRY_S, lambda: _resume(request))
            return
        try:
            if isinstance(result, InvalidTreeError):  # the verifier refused the drafter's tree: fail it over
                request.ahead = None  # drafted on that tree's main line
                request.link.fail(InvalidTreeError(str(result)))
                request.retry_empty = True  # the pending token alone next step, as the per-request engine does
                return
            if isinstance(result, Exception):
                raise result
            request.committed += result.tokens
            if result.feedback is not None:
                request.link.add_feedback(result.feedback)
            if result.features is not None:
                request.link.add_features(result.features)
            self._take_predraft(request)
            ahead = request.ahead_stats
            if ahead:  # (an empty one is left as it is: nothing else writes into it)
                request.ahead_stats = {}
        except Exception as exc:  # the verifier failed the request, or a strict drafter failed
            self._finish(request, exc)
            return
        cpu = request.link.worker.cpu_seconds
        cpu, request.draft_cpu_counted = cpu - request.draft_cpu_counted, cpu
        busy = draft_seconds + ahead.get("predraft_seconds", 0.0)
        step = StepStats(
            num_proposed=tree.num_nodes, tree_depth=tree.max_depth, num_accepted=result.num_accepted,
            accepted_sources=tuple(map(tree.sources.__getitem__, result.accepted_nodes)) if tree.sources else (),
            accepted_ranks=tree.path_ranks(result.accepted_nodes) if reads_ranks(request.method.policy) else None,
            proposed_sources=tree.sources, draft_seconds=draft_seconds, verify_seconds=result.seconds,
            draft_error=request.link.take_errors(), budget=(budget.max_nodes, budget.max_depth),
            step_seconds=time.perf_counter() - step_started,
            wait_seconds=0.0 if request.predrafted else draft_seconds, drafter_busy_seconds=busy,
            batch_sessions=result.batch_sessions, draft_cpu_seconds=cpu, predrafted=request.predrafted, **ahead,
        )
        if request.trace is not None:  # the step as the request's child span (nothing while tracing is off)
            attrs = step_start_attributes(len(request.stats.steps), request.link.drafter_name)
            if request.step_span is not None:  # opened when the step's Verify was sent (a remote loop's)
                request.step_span.set_attributes(attrs | step_attributes(step))
                request.step_span.end()
                request.step_span = None
            else:
                tracing.child_span(request.trace, STEP_SPAN, started_ns, time.time_ns(), attrs | step_attributes(step))
        request.stats.steps.append(step)
        emitted = request.stopper.push(result.tokens)
        request.result.text_limit = request.stopper.text_limit
        request.output.event(StepEvent(tuple(emitted), step, request.stopper.text_limit,
                                       emitted_logprobs(result.logprobs, len(emitted))))
        if request.stopper.done:
            self._finish(request)

    def _finish(self, request: Request, error: BaseException | None = None) -> None:
        """End a request: free its KV, close its drafter, tell its output (once)."""
        if request.status is Status.FINISHED:
            return
        request.status = Status.FINISHED
        with self._lock:
            self._requests.pop(request.request_id, None)
        self._running.pop(request.request_id, None)
        for span in (request.prefill_span, request.step_span):  # a remote call still open: the request ended
            if span is not None:
                if error is not None:
                    tracing.record_error(span, error)
                span.end()
        request.prefill_span = request.step_span = None
        if self.remote is not None:
            with tracing.use(request.trace):
                self.remote.drop(request.request_id)  # the replica's Release joins the request's trace
        else:
            self.scheduler.remove(request.request_id)
        try:  # a background link's closing calls are queued on its worker: the loop does not wait for them
            request.link.close(len(request.stopper.generated), wait=not request.method.background)
        except Exception:  # closing is best effort (a strict link may raise on its sync)
            log.debug("closing the drafter of %s failed", request.request_id, exc_info=True)
        stats, stopper = request.stats, request.stopper
        stats.total_seconds = time.perf_counter() - request.submitted
        stats.num_generated = len(stopper.generated)
        request.result.token_ids = list(stopper.generated)
        request.result.finish_reason = stopper.finish_reason or ("error" if error is not None else "aborted")
        request.result.text_limit = stopper.text_limit
        try:
            request.output.finish(request.result, error)
        except Exception:  # a consumer's bug must not stop the core
            log.exception("request output of %s failed", request.request_id)


class _Admission:
    """A request's admission and prefill, as its replica session's owner (``SessionOwner`` of a RemoteStepLoop;
    on the loop's thread)."""

    def __init__(self, core: EngineCore, request: Request) -> None:
        self.core, self.request = core, request

    def admitted(self) -> bool:
        return self.core._opened(self.request)

    def prefilled(self, result: PrefillResult) -> None:
        self.core._start_decoding(self.request, result.first_token, result.seconds, result.features, result.logprobs)

    def failed(self, exc: BaseException) -> None:
        self.core._finish(self.request, exc)


def _resume(request: Request) -> None:
    """A preempted request steps again (on the loop's thread)."""
    if request.status is Status.PREEMPTED:
        request.status = Status.RUNNING


def draft_batch(items: Sequence[tuple[Request, Budget, list[int], threading.Event | None]]) -> list[PendingDraft | None]:
    """Ask each (request, budget, hypothesis, stop)'s drafter for a tree from its committed tokens + hypothesis:
    the calls to one drafter that takes many at once (``LocalDrafter.propose_many``: a draft model runs one
    forward per level for all of them) in one call, others one by one (inline links; background ones start on
    the drafting pool, all before any is collected). Each item's PendingDraft
    for ``DrafterLink.collect`` (None: no drafter)."""
    pendings: list[PendingDraft | None] = [None] * len(items)
    groups: dict[int, tuple[object, list]] = {}
    for i, (request, budget, hypothesis, stop) in enumerate(items):
        drafter = request.link.drafter
        # a background link's calls go through its worker, in order (its drafter may still be opening there)
        if drafter is not None and hasattr(drafter, "propose_many") and not request.method.background:
            groups.setdefault(id(drafter), (drafter, []))[1].append((i, request.link.prepare(budget, hypothesis, stop)))
        else:
            pendings[i] = request.link.start(budget, hypothesis, stop)
    for drafter, members in groups.values():
        t0, c0 = time.perf_counter(), time.thread_time()
        outcomes = drafter.propose_many([call for _, (call, _) in members])
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        for (i, (call, asked)), outcome in zip(members, outcomes, strict=True):
            pendings[i] = items[i][0].link.answered(asked, call.budget, outcome, seconds, cpu / len(members))
    return pendings


@dataclass(eq=False)
class Step:
    """One step begun (``begin_step``) and not ended: its requests, their (tree, budget, draft seconds), when it
    began, the requests whose next trees are to be drafted ahead (until ``launch``), and the drafting thread's
    job for them (None: none, or not launched)."""

    requests: list[Request]
    drafts: list[tuple[TokenTree, Budget, float]]
    started: float
    started_ns: int
    jobs: list[Request]
    ahead: Future | None = None

    @property
    def verifies(self) -> list[tuple[str, TokenTree]]:
        return [(request.request_id, tree) for request, (tree, _, _) in zip(self.requests, self.drafts, strict=True)]


def late(request: Request, pending: PendingDraft | None) -> bool:
    """Whether a remote drafter's tree (a background link's) has not landed yet. The core never waits for one: its
    request sits out the steps until it lands, the others go on. An in-process drafter's tree is always waited
    for (drafting it is this process's own work, done inline or during the forward)."""
    return request.method.background and pending is not None and not pending.future.done()


def _can_step(request: Request) -> bool:
    """Decoding (not preempted), not in a step already, and not waiting for a remote drafter's tree."""
    return (request.status is Status.RUNNING and not request.in_step
            and not (request.ahead is not None and late(request, request.ahead.pending)))


def _nothing() -> None:
    pass


def _draft_ahead(requests: list[Request]) -> None:
    """The drafting thread's job for one step: every request's pre-draft (one level deeper than the next tree: the
    bonus token is unknown); a greedy one's budget stops when the forward ends (``Predraft.stop``)."""
    items = [(r, predraft_budget(r.ahead.budget, r.ahead.stop, 1), r.ahead.hypothesis, r.ahead.stop) for r in requests]
    for request, pending in zip(requests, draft_batch(items), strict=True):
        request.ahead.pending = pending
