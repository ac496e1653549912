"""The scheduler: one table of a LocalVerifier's sessions, and what each step of it runs.

A ``Scheduler`` owns the sessions of one verifier (one KV pool) for the loop that steps it: the engine core's
requests (orchestrator/core.py) or a verifier replica's callers (``StepLoop``, step_loop.py). Its table holds
one ``Session`` per session id, whose ``status`` says where it is:

    WAITING -> PREFILLING -> DECODING          admitted in arrival order while the pool has its blocks
                  |    ^         |    ^
                  v    |         v    |
                PREEMPTED <------+    RESUMING  (its KV computed again, then it decodes on)

The loop calls it in the order of a step (vLLM V1's ``Scheduler``: requests down, outputs up, no callbacks):

1. ``admit``: resume preempted sessions (oldest admission first), then admit waiting ones in arrival order,
   while the pool has their blocks with a small watermark to spare (a resumed session its tokens', a new one its
   prompt's); what changed comes back as ``Admissions`` for the loop to act on (open a drafter, answer a call).
2. ``schedule(verifies)``: the trees to verify (the loop's: drafted by its proposers, or its callers'), then the
   next prompt chunk of prefilling or resuming sessions while the step's token budget (``max_batch_tokens``)
   lasts, so a long prompt never stalls the others; when the pool lacks the blocks the step's rows write,
   **preemption**: the most recently admitted session gives all its blocks back and leaves the step, until the
   rest fit (a session alone always fits: the context served is what the pool holds). A ``StepBatch`` comes
   back, with the decoding sessions it paused.
3. ``launch(batch)``: the forward queued (on a GPU the host is free until ``finish``; the loop drafts ahead
   then), ``finish(batch)``: acceptance's one copy back, the step's statistics, and a ``StepOutput``: one result
   per tree asked (``PREEMPTED`` for a tree whose session left the step: it steps again once it resumes), the
   prefills that finished and the sessions that resumed.

A model failure in launch or finish becomes every item's result (the loop never sees it raise). Everything runs
on the loop's thread except ``add`` and the counts, which take ``cond`` (the loop's own queues may share it).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.contract import CapacityError, PrefillResult, SessionPreemptedError, VerifyCosts, VerifyResult
from specmesh.metrics import COUNT_BUCKETS, SECONDS_BUCKETS, Buckets
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.arguments import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAITING
from verifier_service.costs import StepCosts

if TYPE_CHECKING:  # the scheduler only calls it: importing it (torch) is its owner's business
    from specmesh.grammar import CompiledGrammar
    from verifier_service.lookahead import LookaheadConfig
    from verifier_service.verifier import LocalVerifier, StepInFlight

log = logging.getLogger("specmesh.scheduler")
PREEMPTED = SessionPreemptedError("the session was preempted for this step's KV blocks; its tree steps once it resumes")


class SessionStatus(enum.Enum):
    WAITING = "waiting"  # queued: the pool lacks its blocks yet
    PREFILLING = "prefilling"  # admitted, prompt chunks still to run
    DECODING = "decoding"  # prefilled: its trees step
    PREEMPTED = "preempted"  # holds no KV blocks until it resumes
    RESUMING = "resuming"  # resumed after its prefill: its KV is computed again, then it decodes


@dataclass(eq=False)
class Session:
    """One session of the table, from ``add`` to ``remove``."""

    session_id: str
    prompt: list[int]
    sampling: SamplingParams
    features: bool = False  # report the session's target features
    feedback_topk: int | None = None  # its feedback (None: the verifier's settings; ``LocalVerifier.admit``)
    lookahead: LookaheadConfig | None = None
    future: Future | None = None  # a Prefill caller's (StepLoop); a cancelled one is dropped while it waits
    # its grammar compiled by the caller before ``add`` (LocalVerifier.compile_grammar): admission takes a copy
    grammar: CompiledGrammar | None = None
    status: SessionStatus = SessionStatus.WAITING
    blocks: int = 0  # KV blocks its admission takes (set by ``add``)
    order: int = 0  # admission order: the newest is preempted first, the oldest resumed first
    prefilled: bool = False  # its first prefill finished
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Admissions:
    """What ``admit`` changed: sessions admitted (their prompts prefill from the next step), refused by the
    verifier (invalid: out of the table), and resumed straight to decoding (all of it in the prefix cache)."""

    admitted: list[Session] = field(default_factory=list)
    refused: list[tuple[Session, Exception]] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)


@dataclass(eq=False)
class StepBatch:
    """One step scheduled: the trees asked (``requested``, in the loop's order), those that step (``verifies``:
    less the sessions preempted for the step's blocks, ``preempted``), the prompt chunks, the decoding sessions
    preempted now (in the step or not: ``paused``, their loop stops stepping them until they resume), the
    sessions decoding when it began, and (set by ``launch``) the step on the device or the error it raised."""

    requested: list[tuple[str, TokenTree]]
    verifies: list[tuple[str, TokenTree]]
    prefills: list[str]
    preempted: set[str]
    paused: list[str]
    decoding: int
    rows: int
    chunk_tokens: int
    in_flight: StepInFlight | None = None
    error: Exception | None = None
    started: float = 0.0


@dataclass
class StepOutput:
    """One step's outcome: one result per tree of ``StepBatch.requested`` (``PREEMPTED`` for one whose session left
    the step), the sessions whose prefill finished with its result (or the error that failed the step: those are
    out of the table), and the sessions that resumed decoding."""

    results: list[VerifyResult | Exception]
    prefilled: list[tuple[Session, PrefillResult | Exception]]
    resumed: list[str]


@dataclass
class BatchStats:
    """What the loop did (read by benchmarks and /metrics). Written by the loop thread only."""

    steps: int = 0
    verified: int = 0  # trees verified
    prefill_chunks: int = 0
    max_batch: int = 0  # most trees in one step
    verify_rows: int = 0  # rows of the trees: the pending token + the tree's nodes each
    prefills: int = 0  # prefills finished
    prefill_tokens: int = 0  # prompt tokens run (every chunk)
    preemptions: int = 0  # sessions that gave their KV blocks back for a step's rows
    # the steps with a session decoding (not prefill-only), the sessions decoding summed over them (in the step
    # or not), and the share of them each step verified, summed: ``stepped_per_running`` below 1 means decoding
    # sessions sat steps out
    decode_steps: int = 0
    decoding: int = 0
    stepped_share: float = 0.0
    # per step, for /metrics (verifier_service/metrics.py): sessions and rows in the forward, its seconds
    batch_sessions: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    batch_rows: Buckets = field(default_factory=lambda: Buckets(COUNT_BUCKETS))
    step_seconds: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))

    def record(self, seconds: float, num_verifies: int, verify_rows: int, num_chunks: int, chunk_tokens: int,
               num_prefilled: int, num_decoding: int | None = None) -> None:
        """One step that ran: ``num_chunks`` prompt chunks of ``chunk_tokens`` tokens in all, ``num_prefilled``
        of which finished their prefill; ``num_decoding``: the sessions decoding when it began, in it or not (None:
        not known, the step is not counted among the decode steps)."""
        self.steps += 1
        if num_decoding:
            self.decode_steps += 1
            self.decoding += num_decoding
            self.stepped_share += num_verifies / num_decoding
        self.verified += num_verifies
        self.max_batch = max(self.max_batch, num_verifies)
        self.verify_rows += verify_rows
        self.prefill_chunks += num_chunks
        self.prefill_tokens += chunk_tokens
        self.prefills += num_prefilled
        self.batch_sessions.observe(num_verifies + num_chunks)
        self.batch_rows.observe(verify_rows + chunk_tokens)
        self.step_seconds.observe(seconds)

    @property
    def mean_batch(self) -> float:
        """Trees verified per forward, over every step (prefill-only ones included)."""
        return self.verified / self.steps if self.steps else 0.0

    @property
    def stepped_per_running(self) -> float:
        """The mean over decode steps of the share of the decoding sessions that stepped (1: none sat out)."""
        return self.stepped_share / self.decode_steps if self.decode_steps else 0.0


class Scheduler:
    """The sessions of one LocalVerifier and the steps that run them (see module doc)."""

    def __init__(self, verifier: LocalVerifier, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_waiting: int = DEFAULT_MAX_WAITING, costs: VerifyCosts | None = None) -> None:
        """``max_batch_tokens``: rows of one forward (prompt chunks fill what the trees leave); ``max_waiting``:
        sessions waiting for KV blocks before the next is refused; ``costs``: the forward's measured costs
        (``LocalVerifier.profile_costs``), kept as ``self.costs``, a ``StepCosts`` refitted to the steps run
        here (verifier_service/costs.py; None: not measured)."""
        if max_batch_tokens < 1 or max_waiting < 0:
            raise ValueError(f"max_batch_tokens must be >= 1 and max_waiting >= 0, got {max_batch_tokens}, "
                             f"{max_waiting}")
        self.verifier = verifier
        self.info = verifier.info
        self.max_tree_nodes = verifier.max_tree_nodes
        self.max_batch_tokens, self.max_waiting = max_batch_tokens, max_waiting
        self.costs = None if costs is None else costs if isinstance(costs, StepCosts) else StepCosts(costs)
        self.stats = BatchStats()
        self.cond = threading.Condition()  # reentrant; guards the table for ``add`` and the counts
        self._table: dict[str, Session] = {}  # every session added and not removed, in arrival order
        self._admitted = 0
        self._num_decoding = 0  # sessions past their first prefill
        self.step_seconds = 0.0  # moving average of a step's time

    # --------------------------------------------------------------- any thread
    def add(self, session: Session) -> None:
        """Queue a new session, or raise why it cannot wait: ValueError (bad input, or its id is taken),
        CapacityError (larger than the whole pool, or ``max_waiting`` already wait for blocks)."""
        # fixed configuration, no lock needed: a request past the context served (what one request alone can hold
        # in the pool) is refused here, so every admitted one can finish
        self.verifier.check_request(session.prompt, session.sampling)
        if session.sampling.grammar is not None and session.grammar is None:
            raise ValueError("a structured session's grammar is compiled before it is added "
                             "(LocalVerifier.compile_grammar)")
        self.verifier.session_feedback(session.feedback_topk, session.lookahead)  # a window too large: refused now
        need = session.blocks = self.verifier.admission_blocks(len(session.prompt))
        with self.cond:
            if session.session_id in self._table:
                raise ValueError(f"session {session.session_id!r} already exists")
            if self._queue_full(need):
                raise CapacityError(f"the verifier is full: {self.num_waiting} requests already wait for KV blocks")
            self._table[session.session_id] = session
            self.cond.notify()

    def get(self, session_id: str) -> Session | None:
        return self._table.get(session_id)

    def has_session(self, session_id: str) -> bool:
        with self.cond:
            return session_id in self._table

    def session_ids(self) -> list[str]:
        with self.cond:
            return list(self._table)

    @property
    def num_sessions(self) -> int:
        return len(self._table)

    @property
    def num_waiting(self) -> int:
        return sum(s.status is SessionStatus.WAITING for s in list(self._table.values()))

    @property
    def num_preempted(self) -> int:
        """Sessions holding no KV blocks until they resume."""
        return sum(s.status is SessionStatus.PREEMPTED for s in list(self._table.values()))

    @property
    def num_decoding(self) -> int:
        """Sessions past their first prefill (preempted or resuming ones included)."""
        return self._num_decoding

    def _queue_full(self, need: int) -> bool:
        """Under the lock: whether a session needing ``need`` blocks would wait for blocks behind ``max_waiting``
        others that do. Queued sessions that the pool can hold now are not waiting: the loop admits them at its
        next round."""
        free = self.verifier.allocator.num_free - self.verifier.watermark_blocks
        blocked = 0
        for session in self._table.values():
            if session.status is SessionStatus.PREEMPTED:  # they come first
                free -= self.verifier.resume_blocks(session.session_id)
        for session in self._table.values():
            if session.status is not SessionStatus.WAITING:
                continue
            if blocked or session.blocks > free:
                blocked += 1
            else:
                free -= session.blocks
        return (blocked > 0 or need > free) and blocked >= self.max_waiting

    # --------------------------------------------------------------- the loop's thread
    def remove(self, session_id: str) -> Session | None:
        """End a session in any status (released, finished, or failed): its blocks go back to the pool now.
        Returns it (None: unknown)."""
        with self.cond:
            session = self._table.pop(session_id, None)
            if session is not None and session.prefilled:
                self._num_decoding -= 1
            self.verifier.release(session_id)
        return session

    def has_work(self) -> bool:
        """Under the lock: a prompt chunk to run, or a session to admit or resume."""
        return any(s.status is SessionStatus.PREFILLING or s.status is SessionStatus.RESUMING
                   for s in self._table.values()) or self._admissible()

    def _fits(self, blocks: int) -> bool:
        """Whether ``blocks`` are free with the watermark to spare (all of them when no session holds any)."""
        allocator = self.verifier.allocator
        spare = self.verifier.watermark_blocks if allocator.num_used else 0
        return blocks + spare <= allocator.num_free

    def _preempted_oldest_first(self) -> list[Session]:
        paused = [s for s in self._table.values() if s.status is SessionStatus.PREEMPTED]
        paused.sort(key=lambda s: s.order)
        return paused

    def _admissible(self) -> bool:
        """Under the lock: the first preempted session can resume, or (none preempted) the first waiting one can
        be admitted."""
        paused = self._preempted_oldest_first()
        if paused:
            return self._fits(self.verifier.resume_blocks(paused[0].session_id))
        head = next((s for s in self._table.values() if s.status is SessionStatus.WAITING), None)
        return head is not None and self._fits(self.verifier.blocks_to_admit(head.prompt, head.features))

    def admit(self) -> Admissions:
        """Resume preempted sessions, oldest admission first, then admit waiting sessions in arrival order, while
        the pool has their blocks (a session whose caller cancelled while it waited is dropped)."""
        out = Admissions()
        with self.cond:
            paused = self._preempted_oldest_first()
            for session in paused:
                sid = session.session_id
                if not self._fits(self.verifier.resume_blocks(sid)):
                    break  # later ones and new admissions wait: the oldest work goes first
                self.verifier.resume(sid)
                paused = paused[1:]
                if not session.prefilled:  # its first prefill goes on
                    session.status = SessionStatus.PREFILLING
                elif self.verifier.prefilling(sid):  # its KV is computed again, then it decodes
                    session.status = SessionStatus.RESUMING
                else:  # all of it found in the prefix cache: it decodes on at once
                    session.status = SessionStatus.DECODING
                    out.resumed.append(sid)
            if paused:
                return out
            for session in [s for s in self._table.values() if s.status is SessionStatus.WAITING]:
                if session.future is not None and session.future.cancelled():  # its caller went away meanwhile
                    del self._table[session.session_id]
                    continue
                if not self._fits(self.verifier.blocks_to_admit(session.prompt, session.features)):
                    break  # wait for blocks; later arrivals do not overtake it
                try:
                    self.verifier.admit(session.session_id, session.prompt, session.sampling, session.features,
                                        session.feedback_topk, session.lookahead, session.grammar)
                except Exception as exc:  # an invalid request
                    del self._table[session.session_id]
                    out.refused.append((session, exc))
                    continue
                session.status = SessionStatus.PREFILLING
                self._admitted += 1
                session.order = self._admitted
                out.admitted.append(session)
        return out

    def schedule(self, verifies: list[tuple[str, TokenTree]]) -> StepBatch | None:
        """The step for ``verifies`` (trees of decoding sessions) and the prompt chunks the token budget leaves,
        with room made in the pool for its rows (preemption); None when there is nothing to run."""
        rows = 0
        for _, tree in verifies:
            rows += tree.num_nodes + 1
        with self.cond:
            decoding = self._num_decoding
            prefills = self._pick_prefills(rows)
        if not verifies and not prefills:
            return None
        preempted, paused = self._make_room(verifies, prefills)
        stepping = verifies
        if preempted:
            stepping = [item for item in verifies if item[0] not in preempted]
            prefills = [sid for sid in prefills if sid not in preempted]
            rows = sum(tree.num_nodes + 1 for _, tree in stepping)
        chunk_tokens = 0
        for sid in prefills:
            chunk_tokens += self.verifier.next_chunk(sid)
        return StepBatch(verifies, stepping, prefills, preempted, paused, decoding, rows, chunk_tokens)

    def launch(self, batch: StepBatch) -> None:
        """Queue the batch's forward with its acceptance (on the CPU it runs here); an error is kept for
        ``finish``."""
        batch.started = time.perf_counter()
        try:
            batch.in_flight = self.verifier.launch(batch.prefills, batch.verifies)
        except Exception as exc:  # a model failure: every session of the step gets it
            log.exception("batched step failed")
            batch.error = exc

    def finish(self, batch: StepBatch) -> StepOutput:
        """Wait for the launched batch's results (one host copy) and account for them (see ``StepOutput``)."""
        firsts: dict[str, int] | Exception
        if batch.error is None:
            try:
                firsts, results = self.verifier.finish(batch.in_flight)
            except Exception as exc:
                log.exception("batched step failed")
                batch.error = exc
        if batch.error is not None:
            firsts, results = batch.error, [batch.error] * len(batch.verifies)
        else:
            seconds = time.perf_counter() - batch.started
            self.step_seconds = 0.8 * self.step_seconds + 0.2 * seconds
            self.stats.record(seconds, len(batch.verifies), batch.rows, len(batch.prefills), batch.chunk_tokens,
                              len(firsts), batch.decoding)
            if self.costs is not None and not batch.prefills:  # (a chunk's rows cost what the line does not model)
                self.costs.observe(len(batch.verifies), batch.rows, seconds)
        if batch.preempted:  # the preempted sessions' results: their trees step again once they resume
            ran = iter(results)
            results = [PREEMPTED if sid in batch.preempted else next(ran) for sid, _ in batch.requested]
        return StepOutput(results, self._prefilled(batch.prefills, firsts), self._resumed(batch.prefills))

    def _pick_prefills(self, verify_rows: int) -> list[str]:
        """Under the lock: resuming, then prefilling sessions whose next chunk fits the step's token budget (at
        least one if nothing else)."""
        budget = self.max_batch_tokens - verify_rows
        chosen = []
        resuming = [s for s in self._table.values() if s.status is SessionStatus.RESUMING]
        prefilling = [s for s in self._table.values() if s.status is SessionStatus.PREFILLING]
        for session in resuming + prefilling:
            chunk = self.verifier.next_chunk(session.session_id)
            if (chosen or verify_rows) and chunk > budget:
                break
            chosen.append(session.session_id)
            budget -= chunk
        return chosen

    def _make_room(self, verifies: Sequence[tuple[str, TokenTree]], prefills: Sequence[str]
                   ) -> tuple[set[str], list[str]]:
        """Preempt the most recently admitted sessions until the pool has the blocks the step's rows write (a
        victim in the step leaves it); returns the victims in the step and the decoding sessions preempted. A
        session alone always fits the pool, so the last one standing is never preempted."""
        need = self.verifier.step_blocks(verifies)
        short = sum(need.values()) - self.verifier.allocator.num_free
        if short <= 0:
            return set(), []
        victims, paused = set(), []
        with self.cond:
            active = [s for s in self._table.values()
                      if s.status is not SessionStatus.WAITING and s.status is not SessionStatus.PREEMPTED]
            active.sort(key=lambda s: s.order)
            while short > 0 and len(active) > 1:
                victim = active.pop()
                sid = victim.session_id
                self.verifier.preempt(sid)  # (blocks it shares with others stay taken)
                need.pop(sid, None)
                short = sum(need.values()) - self.verifier.allocator.num_free
                if victim.status is SessionStatus.DECODING:  # (a resuming one's loop already holds it back)
                    paused.append(sid)
                victim.status = SessionStatus.PREEMPTED
                self.stats.preemptions += 1
                victims.add(sid)
        log.debug("preempted %d sessions for a step's KV blocks", len(victims))
        in_step = {sid for sid, _ in verifies} | set(prefills)
        return victims & in_step, paused

    def _prefilled(self, prefills: list[str], firsts: dict[str, int] | Exception
                   ) -> list[tuple[Session, PrefillResult | Exception]]:
        """The step's prompt chunks whose prefill finished (or failed with the step: out of the table)."""
        told = []
        for sid in prefills:
            session = self._table.get(sid)
            if session is None or session.status is not SessionStatus.PREFILLING:  # (resuming: ``_resumed``)
                continue
            if isinstance(firsts, Exception):
                self.remove(sid)
                told.append((session, firsts))
            elif sid in firsts:
                with self.cond:
                    session.status = SessionStatus.DECODING
                    session.prefilled = True
                    self._num_decoding += 1
                told.append((session, PrefillResult(firsts[sid], time.perf_counter() - session.started,
                                                    self.verifier.take_prompt_features(sid),
                                                    self.verifier.take_first_logprobs(sid))))
        return told

    def _resumed(self, prefills: Sequence[str]) -> list[str]:
        """The resumed sessions whose KV is computed again: they decode on."""
        done = []
        for sid in prefills:
            session = self._table.get(sid)
            if session is not None and session.status is SessionStatus.RESUMING and not self.verifier.prefilling(sid):
                session.status = SessionStatus.DECODING
                done.append(sid)
        return done
