"""Jacobi decoding as a proposer: the target's own predictions for the next positions, refined by fixed-point
iteration, one iteration per verification.

Jacobi decoding (Santilli et al., 2023; the base of lookahead decoding and CLLMs) guesses n tokens after the
context and runs the target on all of them at once: the target's prediction after guess i becomes the new
guess for position i + 1, and the longest prefix whose guesses equal the target's predictions has converged
to the greedy output. Here each verification is that iteration:

- the chain this proposer drafts is the window of guesses for the positions after the pending token;
- the verifier runs the target on it (one forward), accepts the longest prefix the target agrees with (the
  converged prefix) and commits the target's token after it (the bonus: Jacobi's one guaranteed token);
- it reports the target's top-1 after every verified row (``VerifyFeedback``, k >= 1); the prediction after
  row i is the next iteration's guess for the position after that row. Guesses are kept by absolute position,
  so the window moves with the commits (a accepted + 1 bonus positions per step) and PEARL's drafts ahead and
  rollbacks need no bookkeeping: a guess is a guess until verification says otherwise.
- positions with no prediction yet (the window's tail after a long acceptance, the first step) are filled by
  a bigram lookup: the token that most recently followed the previous one in the context (or the previous
  one itself).

Lossless by construction: every token goes through the verifier, greedy or sampled. Under sampling the
drafts are deterministic (point masses), which the verifier's rule accepts with the target's own
probability: the output keeps the target's distribution. (The guesses are the target's greedy predictions, so
sampled acceptance is lower.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree

RECENT_PROPOSALS = 8  # drafts kept to align verifications with (PEARL verifies a draft made a step earlier)


@dataclass
class JacobiSession:
    """Per-session state: the latest guess per absolute position, the context's bigram successors, and the
    recent drafts (context length, tokens) that verification feedback is matched against."""

    guesses: dict[int, int] = field(default_factory=dict)
    successor: dict[int, int] = field(default_factory=dict)  # token -> the token that most recently followed it
    seen: int = 0  # tokens of the context folded into ``successor``
    proposals: deque = field(default_factory=lambda: deque(maxlen=RECENT_PROPOSALS))


def learn_successors(session: JacobiSession, tokens: list[int]) -> None:
    """Fold the context's new bigrams into ``successor`` (a rollback only leaves stale, harmless entries)."""
    start = max(1, min(session.seen, len(tokens)))
    for i in range(start, len(tokens)):
        session.successor[tokens[i - 1]] = tokens[i]
    session.seen = len(tokens)


def window(session: JacobiSession, tokens: list[int], length: int) -> list[int]:
    """The ``length`` guesses for the positions after ``tokens``: the latest target prediction where there is
    one, else the bigram fill from the token before."""
    out: list[int] = []
    previous = tokens[-1]
    for j in range(length):
        guess = session.guesses.get(len(tokens) + j)
        if guess is None:
            guess = session.successor.get(previous, previous)
        out.append(guess)
        previous = guess
    return out


def record_iteration(session: JacobiSession, inputs: list[int], top1: list[int], tokens: list[int]) -> bool:
    """Take one verification's predictions as the next guesses if its rows are one of our recent drafts
    (pending token, then a prefix of the draft's chain): the prediction after row i is the guess for the
    position after it. False if the rows are not ours (another drafter's tree, a trimmed branch)."""
    for length, chain in reversed(session.proposals):
        pending = length - 1
        if (0 <= pending < len(tokens) and inputs[0] == tokens[pending]
                and inputs[1:] == chain[: len(inputs) - 1]):
            for i, prediction in enumerate(top1):
                session.guesses[length + i] = prediction  # row i sits at position pending + i
            return True
    return False


@dataclass
class JacobiProposer(Proposer):
    """Drafts the Jacobi window; needs a verifier that reports its top-1 rows (``feedback_topk``)."""

    name: str = "jacobi"
    feedback_topk: int = 1

    def prepare(self, state: DraftSessionState) -> None:
        session = state.scratch[self.name] = JacobiSession()
        learn_successors(session, state.tokens)

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        session: JacobiSession = self.scratch(state)
        for verified in feedback.verified:
            if verified.k and verified.inputs.size:
                record_iteration(session, verified.inputs.tolist(), verified.topk[:, 0].tolist(), state.tokens)
        if feedback.committed_len:  # positions before the committed end are settled: forget their guesses
            for position in [p for p in session.guesses if p < feedback.committed_len]:
                del session.guesses[position]

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        session: JacobiSession = self.scratch(state)
        learn_successors(session, state.tokens)
        chain = window(session, state.tokens, min(budget.max_nodes, budget.max_depth))
        session.proposals.append((len(state.tokens), chain))
        return TokenTree.chain(chain, source=self.name)


def jacobi_proposer(**given) -> JacobiProposer:
    proposer_options(given, (), "jacobi")
    return JacobiProposer()
