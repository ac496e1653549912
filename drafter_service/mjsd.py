"""MJSD drafting (Qin et al. 2024, arXiv 2407.09722): the draft model's best beam. LOSSY as a whole (opt-in).

Multi-token joint greedy decoding picks the next tokens by their joint probability; MJSD approximates it: the
draft model runs beam search (width B, length gamma) and proposes the beam x_1..x_gamma with the highest joint
draft probability q(x_1..gamma); the verifier accepts its longest prefix whose joint likelihood ratio p/q
reaches a threshold, then the target's argmax after it (``verifier_service.verification.verify_mjsd``). The
orchestrator turns that acceptance on only for this proposer (``ProposerSpec.acceptance``); under exact
acceptance the beam is just another lossless draft.

The proposal is a chain whose ``draft_probs[i]`` is q(x_i | context, x_<i) exactly: the draft's full softmax
at temperature 1, not renormalised over the beam. The beam search is the dynamic tree's level-wise expansion
(``draft_model``): one draft forward per level over the B live beams under a tree mask, each beam's keys and
values staying in the draft cache while its descendants are fed; the B best extensions by cumulative log q
among all B x vocab survive. With B >= vocab^(gamma - 1) it is exhaustive (the top joint-q sequence).

gamma = ``draft_length`` (default: the budget's depth; the registry's default budget is the paper's 4), capped
by the budget. The search ignores ``Budget.stop`` (a pre-draft's "the verification is over"): a shorter beam
is a different sequence, not a prefix of the longer one, and MJSD's output depends on it, so a tree depends on
the context and the budget only; only the deadline cuts it short.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from drafter_service.draft_model import DraftCache, DraftModelProposer, sync_draft_cache
from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.tree import TokenTree, ancestor_mask

DEFAULT_BEAM_WIDTH = 8  # the paper's default


def beam_search(
    step: Callable[[list[int], list[int], int], torch.Tensor],
    first_logits: torch.Tensor,  # [vocab]: the draft's logits after the context
    beam_width: int,
    length: int,
    expired: Callable[[], bool] = lambda: False,
) -> tuple[list[int], list[float]]:
    """Beam search by cumulative log q (full softmax, float64). ``step(parents, tokens, depth)`` runs the draft on
    one level and returns logits [len(tokens), vocab]: live beam k ends in ``tokens[k]`` at depth ``depth`` after
    the context and extends beam ``parents[k]`` of the level before (-1 at the first level: the context). Returns
    the best beam of the last level reached (``length``, or fewer once ``expired()``): its tokens and each
    token's log q(x_i | context, x_<i)."""
    log_q = torch.log_softmax(first_logits.double(), dim=-1)  # [vocab]
    top = torch.topk(log_q, min(beam_width, log_q.numel()))
    beams = [([tok], [lq]) for tok, lq in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    parents, scores = [-1] * len(beams), top.values  # scores: [beams], cumulative log q, best first
    for depth in range(1, length):
        if expired():
            break
        log_q = torch.log_softmax(step(parents, [b[0][-1] for b in beams], depth).double(), dim=-1)
        vocab = log_q.shape[-1]
        total = (scores[:, None] + log_q).reshape(-1)  # [beams * vocab]
        top = torch.topk(total, min(beam_width, total.numel()))
        parent, token = top.indices // vocab, top.indices % vocab
        parents = parent.tolist()
        beams = [(beams[b][0] + [t], beams[b][1] + [float(log_q[b, t])])
                 for b, t in zip(parents, token.tolist(), strict=True)]
        scores = top.values
    return beams[0]  # topk sorts best first


@dataclass
class MJSDProposer(DraftModelProposer):
    """The draft model's best beam as a chain (module docstring). It ranks by the draft's unwarped q whatever
    the session samples (MJSD acceptance is greedy only)."""

    beam_width: int = DEFAULT_BEAM_WIDTH
    draft_length: int | None = None  # gamma; None = the budget's depth
    name: str = "mjsd"

    # beams are searched one session at a time (the draft model's batched chains are not MJSD's beams)
    propose_batch = Proposer.propose_batch

    def _length(self, budget: Budget) -> int:
        return min(budget.max_nodes, budget.max_depth, self.draft_length or budget.max_depth)

    def _rows(self, budget: Budget) -> int:
        return self._length(budget) * self.beam_width + 1  # every level feeds its beams

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        length = self._length(budget)
        if length <= 0 or len(state.tokens) + length > self.runner.info.max_positions:
            return TokenTree.empty()
        dc = self._cache(state)
        with self.kv.hold([dc], [len(state.tokens) + self._rows(budget)]) as ok:
            return self._beam(dc, state, budget, length) if ok[0] else TokenTree.empty()

    def _beam(self, dc: DraftCache, state: DraftSessionState, budget: Budget, length: int) -> TokenTree:
        """The best beam of ``length`` tokens after the session's context (its cache held)."""
        first_logits = sync_draft_cache(self.runner, dc, state.tokens)
        base = len(dc.cached)  # the committed context; beam tokens go after it in the draft cache
        fed_parent: list[int] = []  # per fed row after `base`: the row of its parent (-1 = the context)
        level_rows: list[int] = []  # rows of the level fed last, in the order of its beams

        def step(parents: list[int], tokens: list[int], depth: int) -> torch.Tensor:
            nonlocal level_rows
            first = len(fed_parent)
            fed_parent.extend(level_rows[p] if p >= 0 else -1 for p in parents)
            level_rows = list(range(first, len(fed_parent)))
            # each row sees the context, its own beam's earlier tokens and itself
            attend = TreeMask(base, torch.from_numpy(ancestor_mask(fed_parent)[first:]))
            return self.runner.forward(dc.cache, tokens, [base + depth - 1] * len(tokens), attend).cpu()

        deadline = budget.deadline  # not budget.expired(): the stop event is ignored (module docstring)
        try:
            tokens, log_q = beam_search(step, first_logits, self.beam_width, length,
                                        lambda: deadline is not None and time.monotonic() >= deadline)
        finally:
            dc.cache.truncate(base)  # drop the beams; accepted tokens are re-fed with the next sync
        if budget.min_path_prob > 0:  # SpecDec++'s stop rule on the beam: cut after the token it falls below at
            below = np.flatnonzero(np.cumsum(log_q) < math.log(budget.min_path_prob))
            if len(below):
                tokens, log_q = tokens[: below[0] + 1], log_q[: below[0] + 1]
        return TokenTree.chain(tokens, np.exp(np.asarray(log_q, np.float64)), self.name)


def mjsd_proposer(draft_runner: ModelRunner, **given: object) -> MJSDProposer:
    opts = proposer_options(given, ("beam_width", "draft_length"), "mjsd")
    beam_width = int(opts.get("beam_width", DEFAULT_BEAM_WIDTH))
    draft_length = opts.get("draft_length")
    draft_length = None if draft_length is None else int(draft_length)
    if beam_width < 1 or (draft_length is not None and draft_length < 1):
        raise ValueError(f"mjsd needs beam_width >= 1 and draft_length >= 1, got {beam_width} and {draft_length}")
    return MJSDProposer(draft_runner, beam_width=beam_width, draft_length=draft_length, name="mjsd")
