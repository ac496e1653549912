"""Retrieval drafting (REST) over an n-gram store, and fleet learning into it.

``propose`` looks up the longest stored suffix of the context (``NGramStore.lookup``)
and merges the most frequent continuations into a tree (``weighted_paths_tree``): a
node's draft probability is the share of the stored evidence that continues with it.

The store is filled by ``specmesh ingest`` (a corpus) and, while serving, by:

- fleet learning: as tokens are committed (the orchestrator says how much of the
  context is committed in its feedback), their n-grams go to the store through a
  ``StoreLearner`` thread, off the drafting path. With a Redis store every drafter
  replica learns from every request of the fleet, and it survives restarts;
- lookahead: n-grams the verifier harvested from its Jacobi window (``VerifyFeedback.ngrams``).

Trees carry no draft distributions: the verifier's point-mass rule keeps sampling lossless.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from drafter_service.ngram_store import NGramStore, StoreConfig, StoreLearner, open_store
from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from drafter_service.tree_builders import weighted_paths_tree
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree

LEARN_MODES = ("outputs", "all", "none")


@dataclass
class RetrievalProposer(Proposer):
    store: NGramStore
    learner: StoreLearner | None = None  # None: read the store, never write it
    max_matches: int = 8  # continuations looked up per step
    learn: str = "outputs"  # what goes to the store: generated tokens, prompts too, or nothing
    name: str = "retrieval"

    def __post_init__(self) -> None:
        if self.learn not in LEARN_MODES:
            raise ValueError(f"learn must be one of {', '.join(LEARN_MODES)}, got {self.learn!r}")

    @property
    def feedback_min_ngram(self) -> int:
        """Shortest Jacobi n-gram this proposer learns from (0 = it learns none)."""
        return self.store.config.min_n + 1 if self.learner is not None and self.learn != "none" else 0

    def prepare(self, state: DraftSessionState) -> None:
        # next position whose continuation may be learned: generated tokens only, or the prompt's too
        state.scratch[self.name] = 0 if self.learn == "all" else len(state.tokens)

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        if self.learner is None or self.learn == "none":
            return
        for verified in feedback.verified:
            for gram in verified.ngrams:  # Jacobi harvests: short, so partial continuations count
                if len(gram) > self.store.config.min_n:
                    self.learner.submit(gram, partial=True)
        committed = state.committed_len  # feedback.committed_len, clamped to the context by the drafter
        start = state.scratch.get(self.name, len(state.tokens))
        upto = committed - self.store.config.span + 1  # positions < upto have a whole committed span
        if committed and upto > start:
            lo = max(0, start - self.store.config.max_n)
            self.learner.submit(state.tokens[lo:committed], start=start - lo)
            state.scratch[self.name] = upto

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero:
            return TokenTree.empty()
        found = self.store.lookup(state.tokens[-self.store.config.max_n :], self.max_matches)
        return weighted_paths_tree(found, budget.max_nodes, budget.max_depth, self.name, budget.min_path_prob)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)


def retrieval_proposer(store: NGramStore | None = None, store_spec: str | None = None, store_namespace: str = "default",
               learn: str = "outputs", max_matches: int = 8, **given) -> RetrievalProposer:
    """``store``: a shared NGramStore; else one opened from ``store_spec`` in ``store_namespace``
    (see ``open_store``; None = a fresh in-memory store), with the n-gram options among ``options``
    (min_n, max_n, span, top_n, ttl_s; a snapshot keeps its own)."""
    options = proposer_options(given, tuple(f.name for f in dataclasses.fields(StoreConfig)), "retrieval")
    if store is None:
        config = StoreConfig(**{k: int(v) for k, v in options.items()})
        store = open_store(store_spec, store_namespace, config)
    learner = StoreLearner(store) if learn != "none" else None
    return RetrievalProposer(store, learner, max_matches, learn)
