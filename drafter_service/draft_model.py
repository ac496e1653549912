"""Draft-model proposer: a small causal LM drafts a chain, or a dynamic tree (EAGLE-2 style).

The draft model keeps its own KV cache per session, in one paged pool of the draft runner within a fixed
budget (``draft_kv``: a step holds the blocks its rows write, idle sessions' caches are emptied when the pool
is short). Before drafting, the cache is
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

from drafter_service.draft_kv import DraftCache, DraftKV, draft_kv
from drafter_service.grammar_proposer import allowed_after, synced_grammar
from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget, common_prefix_len
from specmesh.grammar import GrammarState, GrammarTokenizer
from specmesh.logits_process import processes_logits
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.row_ops import argmax_last
from specmesh.tree import TokenTree, ancestor_mask
from specmesh.warp import warp_grouped, warp_groups, warp_probs

# On the CPU, batched greedy chains stop drafting once no chain goes on (reading that costs nothing there); on an
# accelerator every level up to the longest budget runs, so that nothing is read before the chains are done.
# Tests turn it off to hold the device path to one copy per draft step.
CPU_STOPS_EARLY = True


# A sampled draft token is drawn from the DRAFT_SUPPORT most likely tokens of the warped q, renormalised, and that
# distribution ships with the tree exactly (the verifier's rejection sampling stays lossless for any q the draft
# really sampled from). Wider supports (a high temperature without top-k/top-p) lose only their tail; the shape is
# fixed, so that the batched draft decides on the device and ships every level's q in one copy.
DRAFT_SUPPORT = 256


def draft_draws(generator: torch.Generator, levels: int, vocab: int) -> torch.Tensor:
    """[levels, min(DRAFT_SUPPORT, vocab)] float64 Exp(1) draws of one sampled chain, taken from the session's
    generator at the start of the chain, all levels at once: a chain that stops early consumes as many as one
    that does not, so the one-by-one and the batched draft keep the same random stream."""
    return torch.empty(levels, min(DRAFT_SUPPORT, vocab), dtype=torch.float64).exponential_(generator=generator)


def pick_sampled(q: torch.Tensor, exponentials: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A draw from q [..., vocab] (warped, float64) truncated to its DRAFT_SUPPORT most likely tokens: the
    exponential race argmax(q' / E) over the renormalised q'. exponentials: [..., n]. Returns (token, q'(token),
    support ids [..., n], q' over them [..., n]; zeros past q's own support)."""
    top = torch.topk(q, exponentials.shape[-1], dim=-1)
    vals = top.values / top.values.sum(dim=-1, keepdim=True)
    choice = (vals / exponentials).argmax(dim=-1, keepdim=True)
    return top.indices.gather(-1, choice)[..., 0], vals.gather(-1, choice)[..., 0], top.indices, vals


def chain_tree(tokens: Sequence[int], probs: Sequence[float], dists: Sequence[tuple[np.ndarray, np.ndarray]],
               name: str) -> TokenTree:
    """A drafted chain; with ``dists`` (sampling), each node's sparse q ships with it."""
    tree = TokenTree.chain(tokens, probs, name)
    if not dists:
        return tree
    ids, vals = zip(*dists, strict=True)
    sizes = [len(i) for i in ids]
    return TokenTree(
        tree.tokens, tree.parents, tree.draft_probs, tree.sources,
        q_cu=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        q_ids=np.concatenate(ids).astype(np.int64),
        q_probs=np.concatenate(vals).astype(np.float64),
    )


def sync_draft_cache(runner: ModelRunner, dc: DraftCache, committed: list[int]) -> torch.Tensor:
    """Bring the draft cache to ``committed``; return the logits after its last token, [vocab]."""
    # always re-feed at least the last committed token
    common = common_prefix_len(dc.cached, committed, limit=len(committed) - 1)
    dc.cache.truncate(common)
    # drafting decisions run on the host (one [vocab] row per draft forward, wherever the model runs)
    logits = runner.forward(dc.cache, committed[common:], range(common, len(committed)), last_only=True)[-1].cpu()
    dc.cached = list(committed)
    return logits


def sync_draft_caches(runner: ModelRunner, caches: Sequence[DraftCache], contexts: Sequence[list[int]],
                      on_host: bool = True) -> torch.Tensor:
    """``sync_draft_cache`` for many sessions in one forward; the logits after each context's last token,
    [len(caches), vocab] on the host (``on_host``) or on the draft model's device."""
    ids, positions, num_new = [], [], []
    for dc, committed in zip(caches, contexts, strict=True):
        common = common_prefix_len(dc.cached, committed, limit=len(committed) - 1)
        dc.cache.truncate(common)
        ids += committed[common:]
        positions += range(common, len(committed))
        num_new.append(len(committed) - common)
        dc.cached = list(committed)
    last = torch.as_tensor(np.cumsum(num_new) - 1)
    logits = runner.forward_batch([dc.cache for dc in caches], ids, positions, num_new, [None] * len(caches),
                                  last.to(runner.device, non_blocking=True))
    return logits.cpu() if on_host else logits


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

    grammar: GrammarState | None = None  # structured output: the session's grammar, fed this chain's tokens
    fed: int = 0  # drafted tokens the grammar consumed (rolled back when the chain is done)
    draws: torch.Tensor | None = None  # sampling: the chain's Exp(1) draws (``draft_draws``), taken at its first pick

    def pick(self, logits: torch.Tensor, min_confidence: float) -> bool:
        """Choose the next token from ``logits`` [vocab] (greedy: the draft's argmax; sampling: a draw from the
        warped q, whose sparse distribution ships with the tree); whether the chain goes on (another forward).
        It stops at the budget's length, after a token the draft itself doubts (``min_confidence``: likely the
        last one accepted), once the whole path's chance of acceptance is below ``min_path_prob`` (SpecDec++) or
        when the budget expires."""
        sp = self.state.sampling
        logits = self.state.processed(logits, self.tokens)  # penalties and logit_bias, as the verifier's
        ended = False
        if self.grammar is not None:  # structured output: only what the grammar allows, as the verifier masks
            logits = _grammar_masked(logits, self.grammar.allowed())
        if sp.greedy:
            x = int(argmax_last(logits))  # host sync
            self.probs.append(float(torch.softmax(logits.double(), -1)[x]))
        else:
            if self.draws is None:
                self.draws = draft_draws(self.state.generator, self.length, logits.shape[-1])
            q = warp_probs(logits, sp.temperature, sp.top_k, sp.top_p)
            token, q_x, ids, vals = pick_sampled(q, self.draws[len(self.tokens)])
            x = int(token)
            support = vals > 0
            self.dists.append((ids[support].numpy(), vals[support].numpy()))
            self.probs.append(float(q_x))
        self.tokens.append(x)
        if self.grammar is not None:
            ended = x in self.grammar.eos or not self.grammar.matcher.consume_token(x)
            self.fed += not ended
        self.path_prob *= self.probs[-1]
        return not (ended or len(self.tokens) == self.length or self.probs[-1] < min_confidence
                    or self.path_prob < self.budget.min_path_prob or self.budget.expired())

    @property
    def length(self) -> int:
        """The most tokens the budget lets the chain have."""
        return min(self.budget.max_nodes, self.budget.max_depth)

    def tree(self, name: str) -> TokenTree:
        """The drafted chain; when sampling, the sparse q of every node ships with it. The grammar, if any, is rolled
        back to the session's output."""
        if self.grammar is not None:
            self.grammar.rollback(self.fed)
            self.fed = 0
        return chain_tree(self.tokens, self.probs, self.dists, name)


def _grammar_masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Draft logits [vocab] with what the grammar rules out at -inf; unchanged where it allows nothing (a grammar
    complete on a tokenizer without an end of sequence: the verifier decides)."""
    return logits.masked_fill(~allowed, float("-inf")) if allowed.any() else logits


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
    grammar_tokenizer: GrammarTokenizer | None = None  # structured output: drafts follow the request's grammar
    kv: DraftKV | None = None  # the sessions' draft caches; None: the runner's shared pool (draft_kv)
    # a CUDA draft model's own stream (None elsewhere): its forwards and its one copy per proposal neither wait
    # for the target's step queued on the same GPU nor hold up that step's copy (PEARL overlap on one device)
    stream: torch.cuda.Stream | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kv is None:
            self.kv = draft_kv(self.runner)
        device = getattr(self.runner, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            self.stream = torch.cuda.Stream(device)

    def _cache(self, state: DraftSessionState) -> DraftCache:
        """The session's draft cache (an empty one on first use)."""
        dc = state.scratch.get(self.name)
        if dc is None:
            dc = state.scratch[self.name] = self.kv.new()
        return dc

    def _rows(self, budget: Budget) -> int:
        """A bound on the rows one proposal feeds past the context (what ``DraftKV.hold`` reserves)."""
        return budget.max_depth * (self.expand_width if self.tree else 1) + 1

    def _grammar(self, state: DraftSessionState) -> GrammarState | None:
        return synced_grammar(state, self.grammar_tokenizer, f"{self.name}.grammar")

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        with torch.cuda.stream(self.stream):  # (None: no-op)
            return self._propose(state, budget)

    def _propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero or len(state.tokens) + budget.max_depth > self.runner.info.max_positions:
            return TokenTree.empty()
        dc = self._cache(state)
        with self.kv.hold([dc], [len(state.tokens) + self._rows(budget)]) as ok:
            if not ok[0]:
                return TokenTree.empty()
            logits = sync_draft_cache(self.runner, dc, state.tokens)
            if self.tree:
                return self._tree(dc, logits, state, budget)
            return self._chain(dc, logits, state, budget)

    def propose_batch(self, states: Sequence[DraftSessionState], budgets: Sequence[Budget]) -> list[TokenTree]:
        """Chains or dynamic trees for many sessions with one draft forward per level for all of them
        (``forward_batch``: the catch-up tokens of every session in the first, one row per still-drafting chain or
        one per expanded node after), the same as ``propose`` one by one."""
        with torch.cuda.stream(self.stream):
            return self._propose_batch(states, budgets)

    def _propose_batch(self, states: Sequence[DraftSessionState], budgets: Sequence[Budget]) -> list[TokenTree]:
        out = [TokenTree.empty()] * len(states)
        live = [i for i, (state, budget) in enumerate(zip(states, budgets, strict=True))
                if not (budget.is_zero or len(state.tokens) + budget.max_depth > self.runner.info.max_positions)]
        if not live:
            return out
        caches = [self._cache(states[i]) for i in live]
        rows = max(self._rows(budgets[i]) for i in live)  # batched chains feed every chain at every level
        with self.kv.hold(caches, [len(states[i].tokens) + rows for i in live]) as ok:
            kept = [k for k, got in enumerate(ok) if got]  # the others drafted nothing: their trees stay empty
            if kept:
                self._propose_live([live[k] for k in kept], [caches[k] for k in kept], states, budgets, out)
        return out

    def _propose_live(self, live: list[int], caches: list[DraftCache], states: Sequence[DraftSessionState],
                      budgets: Sequence[Budget], out: list[TokenTree]) -> None:
        """``propose_batch``'s drafting for the sessions ``live`` (their caches held): out[i] for each."""
        if not self.tree and all(self._on_device(states[i]) for i in live):
            logits = sync_draft_caches(self.runner, caches, [states[i].tokens for i in live], on_host=False)
            for i, tree in zip(live, self._device_chains([states[i] for i in live], caches, [budgets[i] for i in live],
                                                         logits), strict=True):
                out[i] = tree
            return
        logits = sync_draft_caches(self.runner, caches, [states[i].tokens for i in live])  # [len(live), vocab]
        if self.tree:
            for i, tree in zip(live, self._trees([states[i] for i in live], [budgets[i] for i in live], caches,
                                                 logits), strict=True):
                out[i] = tree
            return
        chains = [_Chain(states[i], budgets[i], caches[k], grammar=self._grammar(states[i]))
                  for k, i in enumerate(live)]
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

    def _on_device(self, state: DraftSessionState) -> bool:
        """Whether the session's chain is drafted by ``_device_chains``: without logit processors or a grammar
        (those decide on the host, token by token)."""
        return not processes_logits(state.sampling) and self._grammar(state) is None

    def _device_chains(self, states: Sequence[DraftSessionState], caches: Sequence[DraftCache],
                       budgets: Sequence[Budget], logits: torch.Tensor) -> list[TokenTree]:
        """Chains for B sessions with every decision on the draft model's device and one copy of the finished
        chains to the host: the same chains as ``_Chain.pick`` one token at a time. Level l picks each greedy
        chain's argmax (and its softmax probability) and draws each sampled chain's token from its warped q
        (``pick_sampled``, with the chain's own draws, taken on the host at the start and copied once); a chain
        goes on while it is shorter than its budget, its last token's probability is at least ``min_confidence``
        and its path's at least ``min_path_prob``. Every chain is fed at every level (a chain that stopped drafts
        on unseen: its later tokens are not shipped, and the draft cache holds them like any other fed token); the
        levels run until the longest budget, or, on the CPU (where reading a tensor costs nothing), until no chain
        goes on. logits: [B, vocab] after each context."""
        b, vocab = logits.shape
        device = logits.device
        lengths = [min(budget.max_nodes, budget.max_depth) for budget in budgets]
        depth = max(lengths)
        limit = torch.tensor(lengths).to(device, non_blocking=True)
        min_path = torch.tensor([budget.min_path_prob for budget in budgets], dtype=torch.float64)
        min_path = min_path.to(device, non_blocking=True)
        sampled = [r for r, state in enumerate(states) if not state.sampling.greedy]
        support = min(DRAFT_SUPPORT, vocab)
        if sampled:  # each sampled chain's draws, from its own generator; greedy rows' are unused ones
            draws = torch.ones(b, depth, support, dtype=torch.float64)
            for r in sampled:
                draws[r, : lengths[r]] = draft_draws(states[r].generator, lengths[r], vocab)
            draws = draws.to(device, non_blocking=True)
            greedy = torch.tensor([state.sampling.greedy for state in states]).to(device, non_blocking=True)
            groups = warp_groups([None if state.sampling.greedy else
                                  (state.sampling.temperature, state.sampling.top_k, state.sampling.top_p)
                                  for state in states], device)  # one warp per group and level
            q_ids = torch.zeros(b, depth, support, dtype=torch.int64, device=device)
            q_vals = torch.zeros(b, depth, support, dtype=torch.float64, device=device)
        tokens = torch.zeros(b, depth, dtype=torch.int64, device=device)
        probs = torch.zeros(b, depth, dtype=torch.float64, device=device)
        alive = torch.ones(b, dtype=torch.bool, device=device)
        count = torch.zeros(b, dtype=torch.int64, device=device)
        path_prob = torch.ones(b, dtype=torch.float64, device=device)
        fed = 0
        for level in range(depth):
            x = argmax_last(logits)  # [B]
            p = torch.softmax(logits.double(), dim=-1).gather(1, x[:, None])[:, 0]
            if sampled:
                q = warp_grouped(logits, groups, torch.float64)  # greedy rows: any distribution (ones)
                token, q_x, ids, vals = pick_sampled(q, draws[:, level])
                x, p = torch.where(greedy, x, token), torch.where(greedy, p, q_x)
                q_ids[:, level], q_vals[:, level] = ids, vals
            tokens[:, level], probs[:, level] = x, p
            count += alive
            path_prob = path_prob * p
            alive = alive & (level + 1 < limit) & (p >= self.min_confidence) & (path_prob >= min_path)
            expired = [budget.expired() for budget in budgets]  # the host's clock: no device read
            if any(expired):
                alive = alive & ~torch.tensor(expired).to(device, non_blocking=True)
            if level + 1 == depth or all(expired) or (CPU_STOPS_EARLY and device.type == "cpu"
                                                      and not bool(alive.any())):
                break
            logits = self.runner.forward_batch([dc.cache for dc in caches], x, [len(dc.cached) + fed for dc in caches],
                                               [1] * b, [None] * b)  # [B, vocab]
            fed += 1
        parts = [count.double()[:, None], tokens.double(), probs]
        if sampled:
            parts += [q_ids.flatten(1).double(), q_vals.flatten(1)]
        host = torch.cat(parts, dim=1).cpu().numpy()  # the one copy
        trees = []
        for r, (dc, row) in enumerate(zip(caches, host, strict=True)):
            chain = row[1 : 1 + depth].astype(np.int64)
            dc.cached.extend(chain[:fed].tolist())
            n = int(row[0])
            dists = []
            if not states[r].sampling.greedy:
                at = 1 + 2 * depth
                ids = row[at : at + depth * support].reshape(depth, support).astype(np.int64)
                vals = row[at + depth * support :].reshape(depth, support)
                dists = [(ids[j][vals[j] > 0], vals[j][vals[j] > 0]) for j in range(n)]
            trees.append(chain_tree(chain[:n].tolist(), row[1 + depth : 1 + 2 * depth][:n].tolist(), dists, self.name))
        return trees

    def prepare(self, state: DraftSessionState) -> None:
        """Prefill the prompt (all but its last token, which the first proposal feeds)."""
        if 1 < len(state.tokens) <= self.runner.info.max_positions:
            self.kv.release(state.scratch.pop(self.name, None))
            dc = self._cache(state)
            with self.kv.hold([dc], [len(state.tokens) - 1]) as ok:
                if ok[0]:  # else the first proposal reads the prompt (or drafts nothing if the pool cannot)
                    with torch.cuda.stream(self.stream):
                        self.runner.forward(dc.cache, state.tokens[:-1], range(len(state.tokens) - 1),
                                            last_only=True)
                    dc.cached = list(state.tokens[:-1])

    def release(self, state: DraftSessionState) -> None:
        self.kv.release(state.scratch.pop(self.name, None))

    # ----------------------------------------------------------------- chain
    def _chain(self, dc: DraftCache, logits: torch.Tensor, state: DraftSessionState, budget: Budget) -> TokenTree:
        chain = _Chain(state, budget, dc, grammar=self._grammar(state))
        while chain.pick(logits, self.min_confidence):
            x = chain.tokens[-1]
            logits = self.runner.forward(dc.cache, [x], [len(dc.cached)])[-1].cpu()  # host sync
            dc.cached.append(x)
        return chain.tree(self.name)

    # ------------------------------------------------------------------ tree
    def _tree(self, dc: DraftCache, logits: torch.Tensor, state: DraftSessionState, budget: Budget) -> TokenTree:
        tree = _DynamicTree(state, budget, dc, self.branching, self.expand_width, logits, self._grammar(state))
        while (feed := tree.next_level()) is not None:
            tokens, positions, attend = feed
            tree.absorb(self.runner.forward(dc.cache, tokens, positions, attend).cpu())
        return tree.finish(self.name)

    def _trees(self, states: Sequence[DraftSessionState], budgets: Sequence[Budget], caches: list[DraftCache],
               logits: torch.Tensor) -> list[TokenTree]:
        """Dynamic trees for many sessions: one draft forward per level for every session still expanding, the
        same trees as ``_tree`` one by one (each session's level attends to its own committed prefix and fed
        ancestors: a tree mask per session)."""
        trees = [_DynamicTree(state, budget, dc, self.branching, self.expand_width, logits[k], self._grammar(state))
                 for k, (state, budget, dc) in enumerate(zip(states, budgets, caches, strict=True))]
        while True:
            feeds = [(t, feed) for t in trees if (feed := t.next_level()) is not None]
            if not feeds:
                break
            step_logits = self.runner.forward_batch(
                [t.dc.cache for t, _ in feeds], [tok for _, (tokens, _, _) in feeds for tok in tokens],
                [p for _, (_, positions, _) in feeds for p in positions], [len(tokens) for _, (tokens, _, _) in feeds],
                [attend for _, (_, _, attend) in feeds]).cpu()  # host sync: one per level for every session
            row = 0
            for t, (tokens, _, _) in feeds:
                t.absorb(step_logits[row : row + len(tokens)])
                row += len(tokens)
        return [t.finish(self.name) for t in trees]


class _DynamicTree:
    """One session's dynamic draft tree (EAGLE-2 style): every level expands the ``expand_width`` best frontier
    candidates by cumulative draft log-probability, each proposing its ``branching`` most likely children; the
    tree kept is the best ``max_nodes`` candidates (a parent outranks its children). Drafted nodes go after the
    committed prefix in the draft cache and are dropped at ``finish`` (accepted ones are re-fed with the next
    sync)."""

    def __init__(self, state: DraftSessionState, budget: Budget, dc: DraftCache, branching: int, expand_width: int,
                 logits: torch.Tensor, grammar: GrammarState | None = None) -> None:
        self.state, self.budget, self.dc, self.grammar = state, budget, dc, grammar
        self.branching, self.expand_width = branching, expand_width
        self.base = len(dc.cached)  # committed length; drafted nodes go after it in the cache
        # candidate arrays, indexed by candidate id
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []
        self.logq: list[float] = []
        self.fed_offset: dict[int, int] = {}  # candidate id -> its offset after `base` in the draft cache
        self.fed_parent: list[int] = []  # per fed offset: offset of its parent (-1 = root)
        self.processes = processes_logits(state.sampling)
        self.frontier = self._add_children(-1, _log_q(self._masked(state.processed(logits), []), state), 0.0, 0)
        self.level = 1  # depth of the children the next expansion adds
        self.expanding: list[int] = []

    def _add_children(self, parent: int, log_q: torch.Tensor, parent_score: float, depth: int) -> list[int]:
        top = torch.topk(log_q, min(self.branching, self.budget.max_nodes))
        ids = []
        for lq, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if lq == float("-inf"):
                break
            self.token.append(tok)
            self.parent.append(parent)
            self.depth.append(depth)
            self.score.append(parent_score + lq)
            self.logq.append(lq)
            ids.append(len(self.token) - 1)
        return ids

    def next_level(self) -> tuple[list[int], list[int], TreeMask] | None:
        """The next level's feed (tokens, positions, attend: committed prefix + each node's fed ancestors + itself),
        or None when the tree is done (depth budget, no frontier, deadline)."""
        if self.level >= self.budget.max_depth or not self.frontier or self.budget.expired():
            return None
        self.expanding = sorted(self.frontier, key=lambda c: -self.score[c])[: self.expand_width]
        first = len(self.fed_parent)
        for c in self.expanding:
            self.fed_offset[c] = len(self.fed_parent)
            self.fed_parent.append(self.fed_offset[self.parent[c]] if self.parent[c] >= 0 else -1)
        attend = TreeMask(self.base, torch.from_numpy(ancestor_mask(self.fed_parent)[first:]))
        return ([self.token[c] for c in self.expanding], [self.base + self.depth[c] for c in self.expanding], attend)

    def absorb(self, step_logits: torch.Tensor) -> None:
        """The level's draft logits (a row per expanded node): their children become the frontier."""
        if self.processes or self.grammar is not None:  # penalties, logit_bias, grammar: each row in its context
            paths = [self._path(c) for c in self.expanding]
            step_logits = torch.stack([self._masked(self.state.processed(step_logits[row], path), path)
                                       for row, path in enumerate(paths)])
        log_q = _log_q(step_logits, self.state)
        self.frontier = []
        for row, c in enumerate(self.expanding):
            self.frontier += self._add_children(c, log_q[row], self.score[c], self.level)
        if self.budget.min_path_prob > 0:  # SpecDec++ stop rule: paths too unlikely to be accepted whole
            self.frontier = [c for c in self.frontier if self.score[c] >= math.log(self.budget.min_path_prob)]
        self.level += 1

    def _masked(self, logits: torch.Tensor, path: list[int]) -> torch.Tensor:
        """Logits [vocab] with what the grammar rules out after ``path`` at -inf (unchanged without a grammar)."""
        return logits if self.grammar is None else _grammar_masked(logits, allowed_after(self.grammar, path))

    def _path(self, c: int) -> list[int]:
        """The drafted tokens from the root to candidate c."""
        path = []
        while c >= 0:
            path.append(self.token[c])
            c = self.parent[c]
        return path[::-1]

    def finish(self, name: str) -> TokenTree:
        """The best ``max_nodes`` candidates as a tree; the drafted nodes leave the draft cache."""
        self.dc.cache.truncate(self.base)
        order = sorted(range(len(self.token)), key=lambda c: (-self.score[c], self.depth[c], c))
        chosen = sorted(order[: self.budget.max_nodes], key=lambda c: (self.depth[c], c))
        new_index = {c: i for i, c in enumerate(chosen)}
        return TokenTree(
            np.asarray([self.token[c] for c in chosen], np.int64),
            np.asarray([new_index[self.parent[c]] if self.parent[c] >= 0 else -1 for c in chosen], np.int64),
            np.exp(np.asarray([self.logq[c] for c in chosen], np.float64)),
            (name,) * len(chosen),
        )


def chain_proposer(draft_runner: ModelRunner, **given: object) -> DraftModelProposer:
    opts = proposer_options(given, ("min_confidence",), "draft_model")
    return DraftModelProposer(draft_runner, tree=False, min_confidence=float(opts.get("min_confidence", 0.0)),
                              name="draft_model", grammar_tokenizer=given.get("grammar_tokenizer"))


def tree_proposer(draft_runner: ModelRunner, **given: object) -> DraftModelProposer:
    opts = proposer_options(given, ("branching", "expand_width"), "draft_model_tree")
    return DraftModelProposer(draft_runner, tree=True, branching=int(opts.get("branching", 4)),
                              expand_width=int(opts.get("expand_width", 4)), name="draft_model_tree",
                              grammar_tokenizer=given.get("grammar_tokenizer"))
