"""Suffix decoding (SuffixDecoding, Oliaro et al. 2025): speculate from a counted suffix trie of the request's own
context and one of the outputs the drafter has written before.

Per session, a ``SuffixIndex`` over the prompt and every committed token (synced at each call: the tokens
committed since the last one are appended; a hypothesis drafted ahead on is matched, never indexed). Per
proposer, a global ``SuffixIndex`` over the outputs of the sessions it closed (``learn="outputs"``; ``"all"``:
prompt and output; ``"none"``: no global index), bounded by ``global_tokens`` (the oldest outputs forgotten
first). Each step both indexes grow a tree from the context's longest match (``suffix_index``: best first by the
empirical probability of each path, up to ``max_spec_factor * match length + max_spec_offset`` nodes, paths
below ``min_token_prob`` cut) and the tree with the larger expected number of accepted tokens goes out.

Draft probabilities are metadata (the share of the matched occurrences that continue with the node): the tree
carries no draft distributions, so the verifier's point-mass rule keeps sampling lossless.

Defaults: ``max_depth`` 24 and ``min_token_prob`` 0.1 as SuffixDecoding and Arctic Inference ship them;
``max_spec_factor`` 2 and ``max_spec_offset`` 8 (theirs: 1 and 0) and a budget of 32 nodes x depth 24, from replaying
SmolLM2-135M-Instruct's greedy outputs on the editing set (``benchmarks/draft_cost.py``, 8 requests): τ 5.92 with
theirs at 24 x 12, 7.05 with 2 and 8, 8.66 at 32 x 24 (warm, the outputs seen once before: 10.0, 10.0, 16.7); a
CPU or GPU verifying a small target is bound by its weights, so the deeper trees cost it little. ``global_tokens``
2^20 (the index's memory per token is reported by ``SuffixProposer.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from drafter_service.suffix_index import SuffixIndex, out_buffers, propose, warm_up
from drafter_service.suffix_log import TOKENS_PER_ENTRY, SuffixLog
from specmesh.contract import Budget
from specmesh.tree import TokenTree

LEARN_MODES = ("outputs", "all", "none")
OPTIONS = ("max_depth", "max_spec_factor", "max_spec_offset", "min_token_prob", "global_tokens", "learn", "fleet")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass
class _Session:
    """A session's own index, how many of its context's tokens it holds, and the arrays its trees are written
    into."""

    index: SuffixIndex
    indexed: int = 0
    buffers: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: out_buffers(32))


@dataclass
class SuffixProposer(Proposer):
    max_depth: int = 24  # the tries' depth: longest match looked for, and levels counted exactly
    max_spec_factor: float = 2.0  # nodes per matched token
    max_spec_offset: float = 8.0  # nodes on top of them
    min_token_prob: float = 0.1  # a path's probability below which it is not extended
    global_tokens: int = 1 << 20  # tokens the global index keeps (0: none)
    learn: str = "outputs"  # what the global index learns from a closed session
    name: str = "suffix"
    global_index: SuffixIndex | None = field(default=None, repr=False)
    fleet_log: SuffixLog | None = field(default=None, repr=False)  # the fleet's stream of outputs (Redis)

    def __post_init__(self) -> None:
        if self.learn not in LEARN_MODES:
            raise ValueError(f"suffix learn must be one of {', '.join(LEARN_MODES)}, got {self.learn!r}")
        if not 2 <= self.max_depth <= 256:
            raise ValueError(f"suffix max_depth must be in [2, 256], got {self.max_depth}")
        if self.max_spec_factor < 0:
            raise ValueError(f"suffix max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.global_tokens < 0:
            raise ValueError("suffix global_tokens must be >= 0")
        if self.global_index is None and self.global_tokens and self.learn != "none":
            self.global_index = SuffixIndex(self.max_depth, self.global_tokens)

    def prepare(self, state: DraftSessionState) -> None:
        state.scratch[self.name] = session = _Session(self._session_index(state))
        self._sync(state, session)

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        session: _Session = self.scratch(state)
        committed = state.committed_len or len(state.tokens)
        if committed < session.indexed:  # the committed context shrank (a host that rewinds): index it again
            self._reindex(state, session)
        if session.buffers[0].shape[1] < budget.max_nodes:
            session.buffers = out_buffers(budget.max_nodes)
        # the tokens to index (committed since the last call) and the context's tail, as one slice
        lo = max(0, min(session.indexed, len(state.tokens) - self.max_depth))
        spec = propose(session.index, self.global_index, state.tokens[lo:], session.indexed - lo, committed - lo,
                       budget.max_nodes, budget.max_depth, max(self.min_token_prob, budget.min_path_prob),
                       self.max_spec_factor, self.max_spec_offset, session.buffers)
        session.indexed = committed
        return TokenTree(spec.tokens, spec.parents, spec.probs, (self.name,) * spec.tokens.shape[0])

    def release(self, state: DraftSessionState) -> None:
        session = state.scratch.pop(self.name, None)
        if session is None or self.global_index is None:
            return
        start = 0 if self.learn == "all" else state.prompt_len
        if len(state.tokens) > start:
            self.global_index.add(state.tokens[start:])
            if self.fleet_log is not None:
                self.fleet_log.publish(state.tokens[start:])

    def _sync(self, state: DraftSessionState, session: _Session) -> None:
        """Index the context's committed tokens not indexed yet (all of them when the host never said)."""
        committed = state.committed_len or len(state.tokens)
        if committed < session.indexed:
            self._reindex(state, session)
        if committed > session.indexed:
            session.index.extend(state.tokens[session.indexed : committed])
            session.indexed = committed

    def _reindex(self, state: DraftSessionState, session: _Session) -> None:
        session.index = self._session_index(state)
        session.indexed = 0
        self._sync(state, session)

    def _session_index(self, state: DraftSessionState) -> SuffixIndex:
        """An empty index for a session's context, unbounded (the session's own tokens), sized for its length."""
        return SuffixIndex(self.max_depth, None, max(256, len(state.tokens)))

    @property
    def stats(self) -> dict[str, int]:
        """The global index's size: tokens, nodes, bytes."""
        g, fleet = self.global_index, self.fleet_log
        return {"global_tokens": g.num_tokens if g else 0, "global_nodes": g.num_nodes if g else 0,
                "global_bytes": g.nbytes if g else 0, "fleet_published": fleet.published if fleet else 0,
                "fleet_received": fleet.received if fleet else 0, "fleet_dropped": fleet.dropped if fleet else 0}


def suffix_proposer(store_spec: str | None = None, store_namespace: str = "default", store=None,
                    **given) -> SuffixProposer:
    """``store_spec``: the host's n-gram store (``store``: one the host opened, as a drafter replica shares its
    ``--ngram-store``); a Redis one carries the fleet's stream of outputs too (``fleet=0``: not), so every
    replica's global index learns from every replica's outputs (``drafter_service/suffix_log.py``)."""
    if store_spec is None and store is not None:  # the Redis it was opened from (a fallback store's primary)
        store_spec = getattr(getattr(store, "primary", store), "url", None)
        store_namespace = store.namespace
    warm_up()  # no request waits for numba's compiler (once per process; ~50 ms from its cache)
    opts = proposer_options(given, OPTIONS, "suffix")
    fleet = str(opts.pop("fleet", 1)).lower() not in ("0", "false", "no", "off")
    kinds = {"max_depth": int, "max_spec_factor": float, "max_spec_offset": float, "min_token_prob": float,
             "global_tokens": int, "learn": lambda v: "none" if v is None else str(v)}  # a method spec's none: None
    proposer = SuffixProposer(**{k: kinds[k](v) for k, v in opts.items()})
    if fleet and proposer.global_index is not None and store_spec and store_spec.startswith(REDIS_SCHEMES):
        proposer.fleet_log = SuffixLog.from_url(store_spec, store_namespace, proposer.global_index,
                                                max(1, proposer.global_tokens // TOKENS_PER_ENTRY))
    return proposer
