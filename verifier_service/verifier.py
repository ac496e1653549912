"""The in-process Verifier (``specmesh.contract.Verifier``) on a target ModelRunner.

A session's KV cache holds every committed token except the newest one (the
"pending" token: the previous bonus, or the first token after prefill). A verify
step runs one forward over [pending, tree nodes...], accepts a path, keeps the
cache entries of pending + the accepted path, and makes the bonus the new pending
token. Plain autoregressive decoding is the same step with an empty tree.

Feedback (off by default, ``VerifyResult.feedback``): with ``feedback_topk`` = k > 0 the
target's top-k next tokens after every verified row (pending + tree nodes), one
``torch.topk`` on the logits the step computes anyway; with ``lookahead`` a Jacobi window
of W guess tokens rides along in the same forward as a branch the tree never sees, and
the n-grams it harvests are reported (``verifier_service/lookahead.py``). Neither changes
what is accepted nor what stays in the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specmesh.contract import PrefillResult, UnknownSessionError, VerifyResult
from specmesh.feedback import VerifyFeedback
from specmesh.model_runner import KVCache, ModelRunner, tree_attend_mask
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree, ancestor_mask
from specmesh.warp import warp_probs
from verifier_service.lookahead import (
    LookaheadConfig,
    branch_parents,
    harvest,
    initial_trail,
    note_successors,
    shift_trail,
    window_positions,
    window_span,
)
from verifier_service.verification import Acceptance, verify_greedy, verify_sample


@dataclass
class _Session:
    cache: KVCache
    pending: int  # newest committed token, not yet in the cache
    sampling: SamplingParams
    generator: torch.Generator | None = field(default=None)
    # lookahead only: the Jacobi window's diagonals ([N - 1, W], last row = the guesses fed next)
    # and the most recent successor of each committed token (fills)
    trail: np.ndarray | None = None
    successors: dict[int, int] = field(default_factory=dict)


class LocalVerifier:
    """Verifier running the target model in this process."""

    def __init__(
        self,
        runner: ModelRunner,
        max_tree_nodes: int = 256,
        feedback_topk: int = 0,
        lookahead: LookaheadConfig | None = None,
    ) -> None:
        if feedback_topk < 0:
            raise ValueError(f"feedback_topk must be >= 0, got {feedback_topk}")
        self.runner = runner
        self.info = runner.info
        self.max_tree_nodes = max_tree_nodes
        self.feedback_topk = min(feedback_topk, runner.info.vocab_size)
        self.lookahead = lookahead
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
        if self.lookahead is not None:
            note_successors(session.successors, prompt + [first])
            session.trail = initial_trail(first, self.lookahead, session.successors)
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
        num_nodes = tree.num_nodes
        trail = session.trail  # [N - 1, W] or None
        span = window_span(prefix_len, trail.shape[1], self.info.max_positions) if trail is not None else 0
        guesses = trail[-1, :span] if trail is not None else np.zeros(0, np.int64)  # [span]
        input_ids = np.concatenate([[session.pending], tree.tokens, guesses])
        positions = np.concatenate([[prefix_len], prefix_len + 1 + tree.depth, window_positions(prefix_len, span)])
        attend = None
        chain = tree.max_depth == num_nodes
        if not chain or (span and num_nodes):  # a real tree, or a chain beside the window: explicit mask
            # the pending token is the root: tree parents shift by one, -1 becomes it; the window is a
            # second chain below it
            anc = ancestor_mask(branch_parents(tree.parents, span))
            attend = tree_attend_mask(prefix_len, torch.from_numpy(anc))
        logits = self.runner.forward(cache, input_ids, positions, attend)  # [1 + num_nodes + span, vocab]
        rows = logits[: num_nodes + 1]  # [num_nodes + 1, vocab]: the verified rows
        acceptance = self._accept(session, tree, rows)
        cache.keep(prefix_len, [0] + [1 + n for n in acceptance.accepted_nodes])  # drops the window rows too
        tokens = acceptance.tokens(tree)
        feedback = None
        if self.feedback_topk or trail is not None:
            topk = None
            if self.feedback_topk:
                topk = torch.topk(rows, self.feedback_topk, dim=-1).indices.numpy()  # [num_nodes + 1, k]; host sync
            ngrams = ()
            if trail is not None:
                ngrams = self._advance_window(session, logits[num_nodes + 1 :], span, tokens)
            feedback = VerifyFeedback.of(input_ids[: num_nodes + 1], topk, ngrams)
        session.pending = acceptance.bonus_token
        return VerifyResult(acceptance.accepted_nodes, tuple(tokens), time.perf_counter() - start, feedback)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -------------------------------------------------------------- internals
    def _get(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    @staticmethod
    def _advance_window(
        session: _Session, window_logits: torch.Tensor, span: int, committed: list[int]
    ) -> list[tuple[int, ...]]:
        """One Jacobi iteration: harvest its n-grams, then shift the window past the committed tokens.

        window_logits: [span, vocab]; committed: the step's accepted tokens + bonus."""
        outputs = window_logits.argmax(dim=-1).numpy()  # [span]; host sync
        ngrams = harvest(session.trail[:, :span], outputs)
        note_successors(session.successors, [session.pending, *committed])
        session.trail = shift_trail(session.trail, outputs, len(committed), committed[-1], session.successors)
        return ngrams

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
