"""The Verifier interface and its in-process implementation on a target ModelRunner.

A session's KV cache holds every committed token except the newest one (the
"pending" token: the previous bonus, or the first token after prefill). A verify
step runs one forward over [pending, tree nodes...], accepts a path, keeps the
cache entries of pending + the accepted path, and makes the bonus the new pending
token. Plain autoregressive decoding is the same step with an empty tree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specmesh.feedback import VerifyFeedback
from specmesh.model_runner import KVCache, ModelInfo, ModelRunner, tree_attend_mask
from specmesh.sampling import SamplingParams, warp_probs
from specmesh.tree import InvalidTreeError, TokenTree, ancestor_mask
from verifier_service.verification import Acceptance, verify_greedy, verify_sample


class UnknownSessionError(KeyError):
    pass


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    seconds: float


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: tuple[int, ...]  # tree node indices along the accepted path
    tokens: tuple[int, ...]  # accepted draft tokens + the bonus token (newly committed)
    seconds: float  # time spent in the verifier (forward + acceptance + compaction)
    feedback: VerifyFeedback | None = None  # top-k rows / Jacobi n-grams, when the verifier is configured for them

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


class Verifier(Protocol):
    info: ModelInfo

    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams) -> PrefillResult: ...

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult: ...

    def release(self, session_id: str) -> None: ...


@dataclass
class _Session:
    cache: KVCache
    pending: int  # newest committed token, not yet in the cache
    sampling: SamplingParams
    generator: torch.Generator | None = field(default=None)


class LocalVerifier:
    """Verifier running the target model in this process."""

    def __init__(self, runner: ModelRunner, max_tree_nodes: int = 256) -> None:
        self.runner = runner
        self.info = runner.info
        self.max_tree_nodes = max_tree_nodes
        self._sessions: dict[str, _Session] = {}

    # --------------------------------------------------------------- protocol
    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams) -> PrefillResult:
        start = time.perf_counter()
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} already exists")
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.info.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + sampling.max_new_tokens > self.info.max_positions:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"target's context of {self.info.max_positions} positions"
            )
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed)
            else:
                generator.seed()  # fresh entropy, without touching torch's global RNG
        cache = self.runner.new_cache()
        logits = self.runner.forward(cache, prompt, range(len(prompt)), last_only=True)  # [1, vocab]
        session = _Session(cache, -1, sampling, generator)
        first = self._accept(session, TokenTree.empty(), logits).bonus_token
        session.pending = first
        self._sessions[session_id] = session
        return PrefillResult(first, time.perf_counter() - start)

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        start = time.perf_counter()
        session = self._get(session_id)
        tree.validate(self.info.vocab_size, max_nodes=self.max_tree_nodes)
        cache = session.cache
        prefix_len = cache.length
        if prefix_len + 1 + tree.max_depth + 1 > self.info.max_positions:
            raise InvalidTreeError("tree would run past the target's context length")
        input_ids = np.concatenate([[session.pending], tree.tokens])
        positions = np.concatenate([[prefix_len], prefix_len + 1 + tree.depth])
        attend = None
        if tree.num_nodes and tree.max_depth < tree.num_nodes:  # a real tree, not a chain: explicit mask
            # the pending token is the root of the tree: parents shift by one, -1 becomes it
            anc = ancestor_mask([-1, *(tree.parents + 1).tolist()])
            attend = tree_attend_mask(prefix_len, torch.from_numpy(anc))
        logits = self.runner.forward(cache, input_ids, positions, attend)  # [num_nodes + 1, vocab]
        acceptance = self._accept(session, tree, logits)
        cache.keep(prefix_len, [0] + [1 + n for n in acceptance.accepted_nodes])
        session.pending = acceptance.bonus_token
        return VerifyResult(acceptance.accepted_nodes, tuple(acceptance.tokens(tree)), time.perf_counter() - start)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -------------------------------------------------------------- internals
    def _get(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    @staticmethod
    def _accept(session: _Session, tree: TokenTree, logits: torch.Tensor) -> Acceptance:
        """logits: [num_nodes + 1, vocab]."""
        sp = session.sampling
        if sp.greedy:
            return verify_greedy(tree, logits.argmax(dim=-1).numpy())  # host sync
        probs = warp_probs(logits, sp.temperature, sp.top_k, sp.top_p)
        return verify_sample(tree, probs, session.generator)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def cache_length(self, session_id: str) -> int:
        return self._get(session_id).cache.length
