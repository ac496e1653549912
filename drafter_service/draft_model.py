"""Draft-model proposer: a small causal LM drafts a chain, or a dynamic tree (EAGLE-2 style).

The draft model keeps its own KV cache per session. Before drafting, the cache is
synchronised with the committed tokens: the longest prefix it already holds (the
drafted tokens the target accepted stay) is kept, the rest is fed in the same
forward that produces the first draft distribution, so catching up costs no
extra forward pass.

Chain: up to k forwards, each token the draft's argmax (greedy) or a sample from
the warped draft distribution q, which is shipped with the tree for lossless
verification. Drafting stops early after a token whose draft probability is
below ``min_confidence`` (as HF assisted generation's confidence threshold does);
the choice depends only on the draft, so it cannot bias the output.

Both honour ``Budget.min_path_prob`` (SpecDec++'s stop rule, with the draft probability as
the acceptance estimate): a path is not extended once the product of its draft
probabilities is below it.

Tree: level by level, the ``expand_width`` highest-scoring frontier nodes (score =
cumulative draft log-probability) are run in one forward with a tree mask and
each proposes its ``branching`` most likely children; at the end the
``max_nodes`` best nodes overall form the tree (ancestor-closed, since a child
never scores above its parent). Children are deterministic top-k picks, i.e.
point masses for lossless sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget, common_prefix_len
from specmesh.model_runner import KVCache, ModelRunner, TreeMask
from specmesh.tree import TokenTree, ancestor_mask
from specmesh.warp import warp_probs


@dataclass
class DraftCache:
    cache: KVCache
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values the cache holds, in order


def sync_draft_cache(runner: ModelRunner, dc: DraftCache, committed: list[int]) -> torch.Tensor:
    """Bring the draft cache to ``committed``; return the logits after its last token, [vocab]."""
    # always re-feed at least the last committed token
    common = common_prefix_len(dc.cached, committed, limit=len(committed) - 1)
    dc.cache.truncate(common)
    # drafting decisions run on the host (one [vocab] row per draft forward, wherever the model runs)
    logits = runner.forward(dc.cache, committed[common:], range(common, len(committed)), last_only=True)[-1].cpu()
    dc.cached = list(committed)
    return logits


def sync_draft_caches(runner: ModelRunner, caches: Sequence[DraftCache], contexts: Sequence[list[int]]) -> torch.Tensor:
    """``sync_draft_cache`` for many sessions in one forward; the logits after each context's last token,
    [len(caches), vocab] on the host."""
    ids, positions, num_new = [], [], []
    for dc, committed in zip(caches, contexts, strict=True):
        common = common_prefix_len(dc.cached, committed, limit=len(committed) - 1)
        dc.cache.truncate(common)
        ids += committed[common:]
        positions += range(common, len(committed))
        num_new.append(len(committed) - common)
        dc.cached = list(committed)
    last = torch.as_tensor(np.cumsum(num_new) - 1)
    return runner.forward_batch([dc.cache for dc in caches], ids, positions, num_new, [None] * len(caches),
                                last.to(runner.device)).cpu()


@dataclass
class _Chain:
    """One session's chain as ``propose_batch`` drafts it: the same choices as ``DraftModelProposer._chain``."""

    state: DraftSessionState
    budget: Budget
    dc: DraftCache
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    dists: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    path_prob: float = 1.0

    def pick(self, logits: torch.Tensor, min_confidence: float) -> bool:
        """Choose the next token from ``logits`` [vocab] (greedy: the draft's argmax; sampling: a draw from the
        warped q, whose sparse distribution ships with the tree); whether the chain goes on (another forward).
        It stops at the budget's length, after a token the draft itself doubts (``min_confidence``: likely the
        last one accepted), once the whole path's chance of acceptance is below ``min_path_prob`` (SpecDec++) or
        when the budget expires."""
        sp = self.state.sampling
        if sp.greedy:
            x = int(logits.argmax())  # host sync
            self.probs.append(float(torch.softmax(logits.double(), -1)[x]))
        else:
            q = warp_probs(logits, sp.temperature, sp.top_k, sp.top_p)
            x = int(torch.multinomial(q, 1, generator=self.state.generator))
            ids = torch.nonzero(q).flatten()
            self.dists.append((ids.numpy(), q[ids].numpy()))
            self.probs.append(float(q[x]))
        self.tokens.append(x)
        self.path_prob *= self.probs[-1]
        length = min(self.budget.max_nodes, self.budget.max_depth)
        return not (len(self.tokens) == length or self.probs[-1] < min_confidence
                    or self.path_prob < self.budget.min_path_prob or self.budget.expired())

    def tree(self, name: str) -> TokenTree:
        """The drafted chain; when sampling, the sparse q of every node ships with it."""
        tree = TokenTree.chain(self.tokens, self.probs, name)
        if not self.dists:
            return tree
        ids, vals = zip(*self.dists, strict=True)
        sizes = [len(i) for i in ids]
        return TokenTree(
            tree.tokens, tree.parents, tree.draft_probs, tree.sources,
            q_cu=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            q_ids=np.concatenate(ids).astype(np.int64),
            q_probs=np.concatenate(vals).astype(np.float64),
        )


def _log_q(logits: torch.Tensor, state: DraftSessionState) -> torch.Tensor:
    """Draft log-probabilities used for ranking: warped like the target's when sampling. [..., vocab]"""
    sp = state.sampling
    if sp.greedy:
        return torch.log_softmax(logits.double(), dim=-1)
    return torch.log(warp_probs(logits, sp.temperature, sp.top_k, sp.top_p))


@dataclass
class DraftModelProposer(Proposer):
    runner: ModelRunner
    tree: bool = False  # False: chain; True: dynamic tree
    branching: int = 4  # children proposed per expanded node (tree)
    expand_width: int = 4  # frontier nodes expanded per level (tree)
    min_confidence: float = 0.0  # chain: stop drafting after a token the draft gives less than this probability
    name: str = "draft_model"

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero or len(state.tokens) + budget.max_depth > self.runner.info.max_positions:
            return TokenTree.empty()
        dc = state.scratch.get(self.name)
        if dc is None:
            dc = state.scratch[self.name] = DraftCache(self.runner.new_cache())
        logits = sync_draft_cache(self.runner, dc, state.tokens)
        if self.tree:
            return self._tree(dc, logits, state, budget)
        return self._chain(dc, logits, state, budget)

    def propose_batch(self, states: Sequence[DraftSessionState], budgets: Sequence[Budget]) -> list[TokenTree]:
        """Chains for many sessions with one draft forward per level for all of them (``forward_batch``: the
        catch-up tokens of every session in the first, one row per still-drafting session after), the same
        chains as ``propose`` one by one; trees are drafted one session at a time."""
        if self.tree:
            return super().propose_batch(states, budgets)
        out = [TokenTree.empty()] * len(states)
        live = [i for i, (state, budget) in enumerate(zip(states, budgets, strict=True))
                if not (budget.is_zero or len(state.tokens) + budget.max_depth > self.runner.info.max_positions)]
        if not live:
            return out
        caches = []
        for i in live:
            dc = states[i].scratch.get(self.name)
            if dc is None:
                dc = states[i].scratch[self.name] = DraftCache(self.runner.new_cache())
            caches.append(dc)
        logits = sync_draft_caches(self.runner, caches, [states[i].tokens for i in live])  # [len(live), vocab]
        chains = [_Chain(states[i], budgets[i], caches[k]) for k, i in enumerate(live)]
        drafting = list(range(len(chains)))  # chains still drafting; row r of logits is chains[drafting[r]]
        while drafting:
            extending = []
            for row, c in enumerate(drafting):
                if chains[c].pick(logits[row], self.min_confidence):
                    extending.append(c)
            if not extending:
                break
            fed = [chains[c] for c in extending]
            logits = self.runner.forward_batch(
                [ch.dc.cache for ch in fed], [ch.tokens[-1] for ch in fed], [len(ch.dc.cached) for ch in fed],
                [1] * len(fed), [None] * len(fed)).cpu()  # host sync: one per level for every session
            for ch in fed:
                ch.dc.cached.append(ch.tokens[-1])
            drafting = extending
        for c, i in enumerate(live):
            out[i] = chains[c].tree(self.name)
        return out

    def prepare(self, state: DraftSessionState) -> None:
        """Prefill the prompt (all but its last token, which the first proposal feeds)."""
        if 1 < len(state.tokens) <= self.runner.info.max_positions:
            dc = state.scratch[self.name] = DraftCache(self.runner.new_cache())
            self.runner.forward(dc.cache, state.tokens[:-1], range(len(state.tokens) - 1), last_only=True)
            dc.cached = list(state.tokens[:-1])

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)

    # ----------------------------------------------------------------- chain
    def _chain(self, dc: DraftCache, logits: torch.Tensor, state: DraftSessionState, budget: Budget) -> TokenTree:
        chain = _Chain(state, budget, dc)
        while chain.pick(logits, self.min_confidence):
            x = chain.tokens[-1]
            logits = self.runner.forward(dc.cache, [x], [len(dc.cached)])[-1].cpu()  # host sync
            dc.cached.append(x)
        return chain.tree(self.name)

    # ------------------------------------------------------------------ tree
    def _tree(self, dc: DraftCache, logits: torch.Tensor, state: DraftSessionState, budget: Budget) -> TokenTree:
        base = len(dc.cached)  # committed length; drafted nodes go after it in the cache
        # Candidate arrays, indexed by candidate id.
        cand_token: list[int] = []
        cand_parent: list[int] = []
        cand_depth: list[int] = []
        cand_score: list[float] = []
        cand_logq: list[float] = []
        fed_offset: dict[int, int] = {}  # candidate id -> its offset after `base` in the draft cache
        fed_parent: list[int] = []  # per fed offset: offset of its parent (-1 = root)

        def add_children(parent: int, log_q: torch.Tensor, parent_score: float, depth: int) -> list[int]:
            k = min(self.branching, budget.max_nodes)
            top = torch.topk(log_q, k)
            ids = []
            for lq, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if lq == float("-inf"):
                    break
                cand_token.append(tok)
                cand_parent.append(parent)
                cand_depth.append(depth)
                cand_score.append(parent_score + lq)
                cand_logq.append(lq)
                ids.append(len(cand_token) - 1)
            return ids

        frontier = add_children(-1, _log_q(logits, state), 0.0, 0)
        for depth in range(1, budget.max_depth):
            if not frontier or budget.expired():
                break
            expand = sorted(frontier, key=lambda c: -cand_score[c])[: self.expand_width]
            first = len(fed_parent)
            for c in expand:
                fed_offset[c] = len(fed_parent)
                fed_parent.append(fed_offset[cand_parent[c]] if cand_parent[c] >= 0 else -1)
            # attend: committed prefix + each new node's fed ancestors + itself
            attend = TreeMask(base, torch.from_numpy(ancestor_mask(fed_parent)[first:]))
            step_logits = self.runner.forward(
                dc.cache, [cand_token[c] for c in expand], [base + cand_depth[c] for c in expand], attend
            ).cpu()
            log_q = _log_q(step_logits, state)
            frontier = []
            for row, c in enumerate(expand):
                frontier += add_children(c, log_q[row], cand_score[c], depth)
            if budget.min_path_prob > 0:  # SpecDec++ stop rule: paths too unlikely to be accepted whole
                frontier = [c for c in frontier if cand_score[c] >= math.log(budget.min_path_prob)]
        dc.cache.truncate(base)  # drop the drafted nodes; accepted ones are re-fed with the next sync
        # Best max_nodes candidates; a parent outranks its children (ties broken by depth).
        order = sorted(range(len(cand_token)), key=lambda c: (-cand_score[c], cand_depth[c], c))
        chosen = sorted(order[: budget.max_nodes], key=lambda c: (cand_depth[c], c))
        new_index = {c: i for i, c in enumerate(chosen)}
        return TokenTree(
            np.asarray([cand_token[c] for c in chosen], np.int64),
            np.asarray([new_index[cand_parent[c]] if cand_parent[c] >= 0 else -1 for c in chosen], np.int64),
            np.exp(np.asarray([cand_logq[c] for c in chosen], np.float64)),
            (self.name,) * len(chosen),
        )


def chain_proposer(draft_runner: ModelRunner, **given: object) -> DraftModelProposer:
    opts = proposer_options(given, ("min_confidence",), "draft_model")
    return DraftModelProposer(draft_runner, tree=False, min_confidence=float(opts.get("min_confidence", 0.0)),
                              name="draft_model")


def tree_proposer(draft_runner: ModelRunner, **given: object) -> DraftModelProposer:
    opts = proposer_options(given, ("branching", "expand_width"), "draft_model_tree")
    return DraftModelProposer(draft_runner, tree=True, branching=int(opts.get("branching", 4)),
                              expand_width=int(opts.get("expand_width", 4)), name="draft_model_tree")
