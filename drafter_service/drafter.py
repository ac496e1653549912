"""The Drafter interface the orchestrator talks to, and its in-process implementation.

A drafter session receives context deltas (tokens committed since the last call)
and answers with a candidate tree within the budget. The in-process drafter keeps
one DraftSessionState per session and delegates to a Proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from drafter_service.proposer import Budget, DraftSessionState, Proposer
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree


class Drafter(Protocol):
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None: ...

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        """Edit the context (drop ``rollback`` tokens, append ``new_tokens``), hand ``feedback`` (what the
        verifier saw, how much of the context is committed) to the proposer, and draft within ``budget``."""
        ...

    def close(self, session_id: str) -> None: ...


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_rollback(rollback: int, context_length: int) -> None:
    """A rollback must leave at least one token of the context; ValueError otherwise."""
    if not 0 <= rollback < context_length:
        raise ValueError(f"cannot roll back {rollback} of the session's {context_length} tokens")


def edit_context(tokens: list[int], new_tokens: Sequence[int], rollback: int) -> None:
    """Apply a context edit in place: drop ``rollback`` tokens from the end, then append ``new_tokens``."""
    check_rollback(rollback, len(tokens))
    if rollback:
        del tokens[-rollback:]
    tokens.extend(new_tokens)


class LocalDrafter:
    """Drafter running one proposer in this process."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self._sessions: dict[str, DraftSessionState] = {}

    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            # draft randomness must be independent of the verifier's
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed + 0x5DEECE66D)
            else:
                generator.seed()  # fresh entropy, without touching torch's global RNG
        state = self._sessions[session_id] = DraftSessionState(session_id, list(prompt), sampling, generator)
        prepare = getattr(self.proposer, "prepare", None)
        if prepare is not None:
            prepare(state)

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        state = self._sessions[session_id]
        edit_context(state.tokens, new_tokens, rollback)
        if feedback is not None:
            if feedback.committed_len:
                state.committed_len = min(feedback.committed_len, len(state.tokens))
            observe = getattr(self.proposer, "observe", None)
            if observe is not None:
                observe(state, feedback)
        if budget.is_zero:  # a context sync (the orchestrator's last call before close)
            return TokenTree.empty()
        return self.proposer.propose(state, budget)

    def context_length(self, session_id: str) -> int:
        return len(self._sessions[session_id].tokens)

    def close(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None:
            self.proposer.release(state)
