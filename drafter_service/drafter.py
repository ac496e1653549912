"""The in-process Drafter (``specmesh.contract.Drafter``): one proposer, sessions in this process.

A drafter session receives context edits (tokens committed since the last call, and
rollbacks of a hypothesis drafted ahead on) and answers with a candidate tree within the
budget. The in-process drafter keeps one DraftSessionState per session and delegates to
a Proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

from drafter_service.proposer import DraftSessionState, Proposer
from specmesh.contract import Budget, DraftCall, check_prompt_len, edit_context
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree


class LocalDrafter:
    """Drafter running one proposer in this process."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self._sessions: dict[str, DraftSessionState] = {}

    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
             prompt_len: int | None = None) -> None:
        check_prompt_len(prompt_len, len(prompt))
        state = self._sessions[session_id] = DraftSessionState(
            session_id, list(prompt), sampling, prompt_len=len(prompt) if prompt_len is None else prompt_len)
        self.proposer.prepare(state)

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        state = self._edit(session_id, new_tokens, rollback, feedback)
        if budget.is_zero:  # a context sync (the orchestrator's last call before close)
            return TokenTree.empty()
        return self.proposer.propose(state, budget)

    def propose_many(self, calls: Sequence[DraftCall]) -> list[TokenTree | Exception]:
        """``propose`` for many sessions at once: every context edit first, then one ``Proposer.propose_batch``
        for the sessions with a budget. Per call its tree, or the exception that call alone raised (a proposer
        that fails in the batch fails every call of it)."""
        out: list[TokenTree | Exception | None] = [None] * len(calls)
        states, budgets, drafting = [], [], []
        for i, call in enumerate(calls):
            try:
                state = self._edit(call.session_id, call.new_tokens, call.rollback, call.feedback)
            except Exception as exc:
                out[i] = exc
                continue
            if call.budget.is_zero:
                out[i] = TokenTree.empty()
            else:
                states.append(state)
                budgets.append(call.budget)
                drafting.append(i)
        if states:
            try:
                trees: list = self.proposer.propose_batch(states, budgets)
            except Exception as exc:
                trees = [exc] * len(states)
            for i, tree in zip(drafting, trees, strict=True):
                out[i] = tree
        return out

    def _edit(self, session_id: str, new_tokens: Sequence[int], rollback: int,
              feedback: DraftFeedback | None) -> DraftSessionState:
        """Apply a context edit and hand the feedback to the proposer; the session's state."""
        state = self._sessions[session_id]
        edit_context(state.tokens, new_tokens, rollback)
        if feedback is not None:
            if feedback.committed_len:
                state.committed_len = min(feedback.committed_len, len(state.tokens))
            self.proposer.observe(state, feedback)
        return state

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def context_length(self, session_id: str) -> int:
        return len(self._sessions[session_id].tokens)

    def close(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None:
            self.proposer.release(state)
