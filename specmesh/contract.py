"""The contracts between the floors: what an orchestrator asks of a drafter and of a verifier.

One torch-free module, so that everything that only moves requests around (the gRPC
orchestrator, the client SDK, the wire conversions) can speak these types without
loading a model stack. Implementations live below their own floors:
``drafter_service`` (LocalDrafter, RemoteDrafter), ``verifier_service`` (LocalVerifier,
RemoteVerifier); the orchestrator's Engine receives them as these protocols.

- ``Budget``: how much a drafter may propose in one step.
- ``Drafter``: a session receives context edits (rollback, then append) and answers
  with a candidate ``TokenTree`` within the budget.
- ``Verifier``: ``prefill`` a session, ``verify`` one tree per step (accepted path +
  bonus token), ``release`` its KV cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from specmesh.feedback import DraftFeedback, TargetFeatures, VerifyFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree


# --------------------------------------------------------------------- budget
@dataclass(frozen=True)
class Budget:
    max_nodes: int  # nodes in the tree (not counting the root)
    max_depth: int  # longest root-to-leaf path
    deadline: float | None = None  # time.monotonic() by which the tree must be ready
    # SpecDec++-style stop rule: stop extending a path once its estimated probability of being
    # accepted whole (product of its nodes' draft probabilities) falls below this; 0 = off
    min_path_prob: float = 0.0
    # set by the orchestrator to end a pre-draft early (PEARL: the verification it overlaps is over)
    stop: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError("budget sizes must be >= 0")
        if not 0.0 <= self.min_path_prob <= 1.0:
            raise ValueError("min_path_prob must be in [0, 1]")

    @property
    def is_zero(self) -> bool:
        return self.max_nodes == 0 or self.max_depth == 0

    def expired(self) -> bool:
        """True once drafting should stop and return what it has: past the deadline, or told to stop."""
        if self.stop is not None and self.stop.is_set():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline


# -------------------------------------------------------------------- drafter
class Drafter(Protocol):
    def open(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
             prompt_len: int | None = None) -> None:
        """Open a session on ``prompt``: the request's prompt, followed by any output committed before this drafter
        opened (after the first token, or on a failover); ``prompt_len`` says where the prompt ends (None: all of it
        is prompt). Penalties on the output (specmesh/logits_process.py) read it."""
        ...

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                feedback: DraftFeedback | None = None) -> TokenTree:
        """Edit the context (``edit_context``: drop ``rollback`` tokens, append ``new_tokens``), hand
        ``feedback`` (what the verifier saw, how much of the context is committed) to the proposer, and
        draft within ``budget``. A zero budget only edits the context (the sync before ``close``)."""
        ...

    def close(self, session_id: str) -> None: ...


class AsyncDrafter(Drafter, Protocol):
    """A drafter whose work happens elsewhere (a replica over gRPC): ``open`` and ``close`` never block, and
    ``propose_async`` hands the call off and returns at once. Its calls take effect in the order they are made,
    so a caller needs no thread of its own to keep them in order (``orchestrator/drafter_link.DraftWorker``)."""

    def propose_async(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int = 0,
                      feedback: DraftFeedback | None = None) -> Future:
        """``propose`` without waiting: a Future of the tree, resolved on another thread; it fails with the
        drafter's error, or with a TimeoutError once ``budget.deadline`` has passed."""
        ...


@dataclass(frozen=True)
class DraftCall:
    """One ``Drafter.propose`` call as data (for drafters that take many at once: ``propose_many``)."""

    session_id: str
    new_tokens: Sequence[int]
    budget: Budget
    rollback: int = 0
    feedback: DraftFeedback | None = None


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


def check_prompt_len(prompt_len: int | None, opened_with: int) -> None:
    """A drafter session's prompt length (None: all it was opened with) must lie within what it was opened with;
    ValueError otherwise."""
    if prompt_len is not None and not 0 <= prompt_len <= opened_with:
        raise ValueError(f"prompt_len must be in [0, {opened_with}], got {prompt_len}")


def edit_context(tokens: list[int], new_tokens: Sequence[int], rollback: int) -> None:
    """Apply a context edit in place: drop ``rollback`` tokens from the end, then append ``new_tokens``."""
    check_rollback(rollback, len(tokens))
    if rollback:
        del tokens[-rollback:]
    tokens.extend(new_tokens)


# ------------------------------------------------------------------- verifier
@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]


MAX_SESSION_ID_CHARS = 128


def check_session_id(session_id: str) -> None:
    """ValueError unless a session id is 1 to MAX_SESSION_ID_CHARS characters."""
    if not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise ValueError(f"session_id must be 1 to {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")


class UnknownSessionError(KeyError):
    """The verifier holds no session of that id (never opened, released, reaped or owned by another caller)."""


class SessionReleasedError(RuntimeError):
    """A release of the session overtook a call on it (a Prefill waiting or running, a Verify not yet stepped):
    that call ends with this, and the session is gone (its KV blocks back in the pool)."""


class SessionPreemptedError(RuntimeError):
    """A step gave the session's KV blocks back to the pool before its tree ran (the pool ran short): the tree
    steps once the session has resumed. A step loop's driver sees it, and a VerifyBatch item (RESOURCE_EXHAUSTED
    with ``PREEMPTED_MESSAGE``: sent again later); a plain Verify call waits for the session instead."""


PREEMPTED_MESSAGE = "preempted for KV blocks, send the tree again"


class CapacityError(RuntimeError):
    """The verifier cannot take the request now (its KV pool or its admission queue is full): retry later or
    elsewhere. Raised before any work is done, never for a session already admitted."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of committed tokens under the distribution each was decoded from: the target's at
    verification, after logit processors and warping (greedy: the processed logits' softmax), as OpenAI's
    ``logprobs`` define them; the same numbers plain decoding gives. One entry per token."""

    token_ids: tuple[int, ...]  # [n] the tokens
    logprobs: tuple[float, ...]  # [n] each token's
    top_ids: tuple[tuple[int, ...], ...] = ()  # [n][k] the k most likely tokens of each row (k = the request's)
    top_logprobs: tuple[tuple[float, ...], ...] = ()  # [n][k] their log-probabilities

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first n entries (the tokens a stop condition lets out)."""
        return TokenLogprobs(self.token_ids[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(self.token_ids + other.token_ids, self.logprobs + other.logprobs,
                             self.top_ids + other.top_ids, self.top_logprobs + other.top_logprobs)

    @staticmethod
    def join(parts: Iterable[TokenLogprobs | None]) -> TokenLogprobs | None:
        """The parts of one output in order, as one (the pieces a stream carried); None when none has any."""
        joined = None
        for part in parts:
            if part is not None:
                joined = part if joined is None else joined + part
        return joined


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    seconds: float
    features: TargetFeatures | None = None  # the prompt's target features, when the verifier reports them
    logprobs: TokenLogprobs | None = None  # the first token's, when the request asks (SamplingParams.logprobs)


@dataclass(slots=True)  # not frozen: one per request and step, and a frozen init of 7 fields costs 2 µs
class VerifyResult:
    accepted_nodes: tuple[int, ...]  # tree node indices along the accepted path
    tokens: tuple[int, ...]  # accepted draft tokens + the bonus token (newly committed)
    seconds: float  # time spent in the verifier (forward + acceptance + compaction)
    feedback: VerifyFeedback | None = None  # top-k rows / Jacobi n-grams, when the verifier is configured for them
    batch_sessions: int = 1  # sessions verified in the same forward (the verifier's load at this step)
    features: TargetFeatures | None = None  # target features of the pending + accepted rows, when reported
    logprobs: TokenLogprobs | None = None  # of ``tokens``, when the request asks (SamplingParams.logprobs)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@dataclass(frozen=True)
class VerifyCosts:
    """A verifier's batched forward time, seconds = base + per_session * sessions + per_row * rows
    (rows: every token fed, all sessions together), measured by the verifier on its own hardware."""

    base: float
    per_session: float
    per_row: float

    def seconds(self, sessions: int, rows: int) -> float:
        return self.base + self.per_session * sessions + self.per_row * rows


class ForwardCosts(Protocol):
    """What a load-aware policy reads of a verifier's costs: a ``VerifyCosts`` as measured, or one refitted to the
    verifier's steps as it serves (``StepCosts``, verifier_service/costs.py)."""

    def seconds(self, sessions: int, rows: int) -> float: ...


class Verifier(Protocol):
    info: ModelInfo

    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                features: bool = False) -> PrefillResult:
        """Admit the session and run its prompt; the first token. ``features``: report the target's features
        of this session (``PrefillResult.features``, then every ``VerifyResult.features``) for a feature-based
        drafter (Falcon heads)."""
        ...

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        """One forward over the session's pending token and ``tree``; accepts a path, appends the bonus
        token. Raises InvalidTreeError for a tree that breaks the contract, UnknownSessionError."""
        ...

    def release(self, session_id: str) -> None: ...


class BatchVerifier(Verifier, Protocol):
    """A verifier that verifies the trees of many sessions in one forward."""

    def verify_batch(self, requests: Sequence[tuple[str, TokenTree]]) -> list[VerifyResult | Exception]:
        """One forward over every (session_id, tree) (each session at most once); per request its result,
        or the exception ``verify`` would have raised for it alone (the others are unaffected)."""
        ...
