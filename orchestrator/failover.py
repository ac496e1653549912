"""A Drafter that fails over along a list of drafters, resuming each with the full context.

The orchestrator gives every request the replicas in least-loaded order, then a
local model-free proposer. When the current drafter raises (dead, timed out,
unreachable) or returns a tree that breaks the budget or the vocabulary, the next
one is opened with every committed token so far and drafts from the next step
on; the step whose drafter failed is verified with an empty tree.
Only when every candidate failed does ``propose`` raise, and the engine decodes
without drafts. None of this changes the output: drafts never do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from drafter_service.drafter import Drafter, edit_context
from drafter_service.proposer import Budget
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

log = logging.getLogger("specmesh.failover")

DrafterFactory = Callable[[], Drafter]


class AllDraftersFailed(RuntimeError):
    pass


@dataclass
class _Session:
    tokens: list[int]
    sampling: SamplingParams
    index: int = -1  # candidate in use
    drafter: Drafter | None = None
    num_seen: int = 0  # tokens the current drafter already has
    errors: list[str] = field(default_factory=list)


class FailoverDrafter:
    def __init__(
        self,
        candidates: Sequence[tuple[str, DrafterFactory]],
        vocab_size: int | None = None,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        """``candidates``: (name, factory) in order of preference; factories are called only when needed.
        ``on_failure(session_id, message)`` hears of every failure (for stats and traces)."""
        self.candidates = list(candidates)
        self.vocab_size = vocab_size
        self.on_failure = on_failure
        self._sessions: dict[str, _Session] = {}

    # --------------------------------------------------------------- protocol
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        session = _Session(list(prompt), sampling)
        self._sessions[session_id] = session
        self._next(session_id, session)

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        session = self._sessions[session_id]
        edit_context(session.tokens, new_tokens, rollback)
        while session.drafter is not None:
            name = self.candidates[session.index][0]
            # the current drafter holds tokens[:num_seen] as of its last call: edit it from there
            keep = min(session.num_seen, len(session.tokens) - len(new_tokens))
            try:
                tree = session.drafter.propose(session_id, session.tokens[keep:], budget, session.num_seen - keep,
                                               feedback)
                session.num_seen = len(session.tokens)
                if self.vocab_size is not None:
                    tree.validate(self.vocab_size, budget.max_nodes, budget.max_depth)
                return tree
            except Exception as exc:  # any failure of a drafter moves on to the next one
                if budget.is_zero:  # a context sync (before close): not worth opening another replica
                    self._record(session_id, session, f"{name}: {type(exc).__name__}: {exc}")
                    self._close_current(session_id, session)
                    return TokenTree.empty()
                self._fail(session_id, session, name, exc)
                if session.drafter is not None:
                    # the next drafter starts with the next step: its first proposal (connect,
                    # draft prefill) gets a whole step's deadline instead of what is left of this one
                    return TokenTree.empty()
        raise AllDraftersFailed("; ".join(session.errors))

    def close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._close_current(session_id, session)

    # -------------------------------------------------------------- internals
    def errors(self, session_id: str) -> list[str]:
        """Failures seen so far in a session (for logs and stats)."""
        return list(self._sessions[session_id].errors)

    def current(self, session_id: str) -> str | None:
        session = self._sessions[session_id]
        return self.candidates[session.index][0] if session.drafter is not None else None

    def _fail(self, session_id: str, session: _Session, name: str, exc: Exception) -> None:
        self._record(session_id, session, f"{name}: {type(exc).__name__}: {exc}")
        self._close_current(session_id, session)
        self._next(session_id, session)

    def _record(self, session_id: str, session: _Session, message: str) -> None:
        session.errors.append(message)
        log.warning("session %s: drafter failed (%s); failing over", session_id, message)
        if self.on_failure is not None:
            self.on_failure(session_id, message)

    def _next(self, session_id: str, session: _Session) -> None:
        """Open the next candidate that opens; leaves ``session.drafter`` None when none is left."""
        while session.index + 1 < len(self.candidates):
            session.index += 1
            name, factory = self.candidates[session.index]
            try:
                drafter = factory()
                drafter.open(session_id, session.tokens, session.sampling)
            except Exception as exc:
                self._record(session_id, session, f"{name}: {type(exc).__name__}: {exc}")
                continue
            session.drafter, session.num_seen = drafter, len(session.tokens)
            return

    @staticmethod
    def _close_current(session_id: str, session: _Session) -> None:
        if session.drafter is not None:
            try:
                session.drafter.close(session_id)
            except Exception:  # best effort: it may be the drafter that just died
                pass
            session.drafter = None
