"""Tree verification: which path of a candidate tree the target accepts, plus one bonus token.

Pure functions over a TokenTree and the target's outputs at the tree's positions.
Row 0 of every target array belongs to the tree's root (the last committed token),
row i + 1 to node i: row r holds the target's prediction for the *children* of r.

- ``verify_greedy``: follow the child whose token equals the target's argmax; the
  first position without such a child yields the bonus token (the argmax there).
  Output is exactly autoregressive greedy decoding.
- ``verify_sample``: recursive rejection sampling (SpecInfer / RSD). At a node with
  target distribution p, children are tried in index order; child c (drawn from
  q_c, conditioned on the siblings tried before it) is accepted with probability
  min(1, p(x_c) / q_c(x_c)); on rejection p <- normalize(max(p - q_c, 0)). If no
  child is accepted, the bonus token is drawn from the current p. This keeps the
  output distribution identical to sampling from the target. A deterministic pick
  is the point mass q_c = delta(x_c): accept with probability p(x_c), else zero
  x_c out of p and renormalise. It is ``verify_sample_batch`` for one tree (one walk).
- ``verify_mjsd``: MJSD's joint-likelihood acceptance (Qin et al. 2024, arXiv 2407.09722),
  greedy only and LOSSY (sessions whose ``SamplingParams.acceptance`` is ``mjsd``; see its
  docstring for the exact rule).

Batched serving verifies many requests' trees from one target forward. The target's
outputs then arrive packed: request r owns rows ``cu_rows[r]:cu_rows[r + 1]`` (its
tree's num_nodes + 1 rows, laid out as above), on the model's device.

- ``verify_greedy_batch``: one argmax over all rows and one host copy, then
  ``verify_greedy`` per tree.
- ``sample_trees``: the rule of ``verify_sample`` for every tree of the batch at once, on the
  probabilities' device and without a host sync (the verifier copies its decisions to the host
  together with everything else a step needs: ``verifier_service/decisions.py``). The host lays
  the trees out once (``plan_trees``: children tables, sparse draft distributions); every node's
  test is decided at once (a child's p is its parent's row after the earlier siblings' rejections,
  kept unnormalised, a residual written on q's support only: ``residual_sparse``), the walk is a
  chase of "first accepted child" pointers, and the bonus token is an exponential race over the
  last node's residual. ``sample_packed`` adds the layout and the draws; ``verify_sample_batch``
  wraps it for callers that want ``Acceptance``s. Every request draws from its own generator (seeded) or from
  one shared draw (``draw_randoms``). ``verify_sample`` remains the host reference the tests hold
  ``sample_trees`` to, draw for draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from specmesh.row_ops import argmax_last
from specmesh.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: tuple[int, ...]  # node indices along the accepted path, root's child first
    bonus_token: int  # the target's own token after the accepted path

    def tokens(self, tree: TokenTree) -> list[int]:
        """Accepted draft tokens followed by the bonus token."""
        if not self.accepted_nodes:  # plain decoding's every step
            return [self.bonus_token]
        return [int(tree.tokens[i]) for i in self.accepted_nodes] + [self.bonus_token]


def verify_greedy(tree: TokenTree, target_argmax: np.ndarray) -> Acceptance:
    """target_argmax: [num_nodes + 1] int, the target's argmax at the root and at each node."""
    assert target_argmax.shape == (tree.num_nodes + 1,), target_argmax.shape
    tokens, children = tree.tokens.tolist(), tree.children  # (plain loops: no Python frame per node looked at)
    accepted: list[int] = []
    node = -1
    while True:
        want = int(target_argmax[node + 1])
        for child in children[node + 1]:  # the first child (in index order) the target agrees with
            if tokens[child] == want:
                accepted.append(child)
                node = child
                break
        else:
            return Acceptance(tuple(accepted), want)


def verify_greedy_chains(
    target_argmax: np.ndarray,  # [R] int: packed target outputs; chain r's are rows firsts[r] .. firsts[r] + n_r
    firsts: np.ndarray,  # [B] int64: chain r's root row
    tokens: np.ndarray,  # [total_nodes] int64: the chains' tokens, packed (chain r: cu_nodes[r]:cu_nodes[r + 1])
    cu_nodes: np.ndarray,  # [B + 1] int64
) -> tuple[np.ndarray, np.ndarray]:
    """``verify_greedy`` for B chains (the empty tree included) in one vectorised pass: chain r accepts its
    first num_accepted[r] nodes (the longest prefix the target's argmax agrees with), then bonus[r].
    Returns (num_accepted [B] int64, bonus [B] int64)."""
    counts = np.diff(cu_nodes)
    total = int(cu_nodes[-1])
    depth = np.arange(total) - np.repeat(cu_nodes[:-1], counts)  # node's index within its chain
    agrees = tokens == target_argmax[np.repeat(firsts, counts) + depth]  # row of a node's parent: first + depth
    # the first disagreement of each chain (its length when there is none)
    stop = np.where(agrees, np.repeat(counts, counts), depth)
    num_accepted = counts.copy()
    nonempty = counts > 0
    if nonempty.any():
        num_accepted[nonempty] = np.minimum.reduceat(stop, cu_nodes[:-1][nonempty])
    return num_accepted, target_argmax[firsts + num_accepted].astype(np.int64)


def verify_mjsd(tree: TokenTree, target_argmax: np.ndarray, target_logprobs: np.ndarray,
                threshold: float) -> Acceptance:
    """MJSD verification (LOSSY: the output is not the target's own greedy decoding).

    target_argmax: [num_nodes + 1] int, the target's argmax at the root and at each node (as ``verify_greedy``);
    target_logprobs: [num_nodes] float, log p(x_i | context, path to i): node i's token under the target's
    full softmax in its parent's row; q(x_i | ...) is ``tree.draft_probs[i]``, the draft's own probability.

    The rule: a node's joint likelihood ratio is R_i = prod over its path x_1..x_i of p(x_j | x_<j) / q(x_j | x_<j)
    = p(x_1..i) / q(x_1..i). The accepted path ends at the DEEPEST node with R_i >= ``threshold`` (the longest
    prefix passing the test, not the prefix before the first failure: R may rise again after a dip; ties in
    depth go to the higher R, then the lower index), or at the root if none passes; then one bonus token, the
    target's argmax after the last accepted node. For a chain (the mjsd proposer's best beam) this is the
    paper's longest accepted prefix; any other tree gets the rule on each root-to-leaf path, keeping the longest
    accepted prefix. With the draft = the target (R = 1) every drafted token passes a threshold < 1; with a
    threshold no prefix reaches, the output is the target's greedy decoding."""
    n = tree.num_nodes
    assert target_argmax.shape == (n + 1,), target_argmax.shape
    assert target_logprobs.shape == (n,), target_logprobs.shape
    if not threshold > 0:
        raise ValueError(f"the MJSD threshold must be > 0, got {threshold}")
    # log q clamped: a drafter claiming q = 0 gets a huge ratio, never NaN (log p = -inf still fails)
    log_ratio = target_logprobs.astype(np.float64) - np.log(np.maximum(tree.draft_probs, np.finfo(np.float64).tiny))
    joint = np.empty(n, np.float64)  # log R_i; parents[i] < i, so one pass in index order
    for i in range(n):
        parent = int(tree.parents[i])
        joint[i] = log_ratio[i] + (joint[parent] if parent >= 0 else 0.0)
    passing = np.flatnonzero(joint >= np.log(threshold))
    if not len(passing):
        return Acceptance((), int(target_argmax[0]))
    depth = tree.depth
    last = int(min(passing, key=lambda i: (-depth[i], -joint[i], i)))
    path = []
    node = last
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return Acceptance(tuple(reversed(path)), int(target_argmax[last + 1]))


def node_logprobs(trees: Sequence[TokenTree], logits: torch.Tensor, firsts: Sequence[int]) -> list[np.ndarray]:
    """log p(x_i | ...) of every node of every tree (``node_logprobs_device``) on the host, [num_nodes] per tree."""
    logp = node_logprobs_device(trees, logits, firsts).cpu().numpy()  # [total_nodes]; host sync
    cu = np.cumsum([0] + [tree.num_nodes for tree in trees])
    return [logp[a:b] for a, b in pairwise(cu)]


def node_logprobs_device(trees: Sequence[TokenTree], logits: torch.Tensor, firsts: Sequence[int]) -> torch.Tensor:
    """log p(x_i | ...) of every node of every tree, packed [total_nodes] on the logits' device: tree r's outputs
    are rows [firsts[r], firsts[r] + num_nodes + 1) of logits [R, vocab], row 0 the root's; node i's token is read
    from its parent's row. One log-softmax over the parents' rows (float32) and one gather for all trees."""
    rows = np.concatenate([first + 1 + tree.parents for tree, first in zip(trees, firsts, strict=True)] + [[]])
    cols = np.concatenate([tree.tokens for tree in trees] + [[]])
    if not len(rows):
        return torch.zeros(0, device=logits.device)
    index = torch.from_numpy(rows.astype(np.int64)).to(logits.device, non_blocking=True)
    picked = logits[index].float()  # [total_nodes, vocab]
    logp = picked.gather(1, torch.from_numpy(cols.astype(np.int64)).to(logits.device, non_blocking=True)[:, None])[:, 0]
    return logp - torch.logsumexp(picked, dim=-1)


def verify_sample(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """target_probs: [num_nodes + 1, vocab] float64, warped target distributions (sum to 1 per row).
    The reference walk, on the host: ``sample_trees`` is held to it on random trees and draws."""
    assert target_probs.shape[0] == tree.num_nodes + 1, (target_probs.shape, tree.num_nodes)
    uniforms = torch.rand(tree.num_nodes, generator=generator, dtype=torch.float64)
    rows = torch.from_numpy(tree.parents + 1)
    p_tokens = target_probs[rows.to(target_probs.device), torch.from_numpy(tree.tokens).to(target_probs.device)]
    accepted, bonus_p = _walk_sample(tree, target_probs, uniforms.numpy(), p_tokens.cpu().numpy())
    return Acceptance(tuple(accepted), int(torch.multinomial(bonus_p.cpu(), 1, generator=generator)))


def residual(p: torch.Tensor, q_ids: torch.Tensor, q_vals: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) for a dense p [vocab] and a sparse q (q_ids, q_vals: [nnz])."""
    r = p.clone()
    r.index_add_(0, q_ids.long(), -q_vals)
    r.clamp_(min=0.0)
    total = r.sum()
    # p == q up to rounding (total 0): the child would have been accepted surely; keep p. A select, not an
    # `if`, so that no host sync is needed on a device
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


# ------------------------------------------------------------------ batched
def verify_greedy_batch(
    trees: Sequence[TokenTree],
    logits: torch.Tensor,  # [total_rows, vocab], on any device
    cu_rows: Sequence[int],  # [num_trees + 1], tree r owns rows cu_rows[r]:cu_rows[r + 1]
) -> list[Acceptance]:
    """``verify_greedy`` for every tree, from one argmax over the packed rows."""
    spans = _row_spans(trees, logits, cu_rows)
    target_argmax = argmax_last(logits).cpu().numpy()  # [total_rows]; host sync, the only one
    return [verify_greedy(tree, target_argmax[lo:hi]) for tree, (lo, hi) in zip(trees, spans, strict=True)]


def verify_sample_batch(
    trees: Sequence[TokenTree],
    probs: torch.Tensor,  # [total_rows, vocab] float32/64, warped target distributions (sum to 1 per row)
    cu_rows: Sequence[int],  # [num_trees + 1], tree r owns rows cu_rows[r]:cu_rows[r + 1]
    generators: Sequence[torch.Generator | None],  # [num_trees] on probs.device; request r uses only its own
    shared: torch.Generator | None = None,  # draws of the trees without a generator of their own (None: torch's)
) -> list[Acceptance]:
    """``verify_sample`` for every tree, with the same output law (not the same random stream), decided on the
    probabilities' device for the whole batch (``sample_trees``) and copied to the host once."""
    assert probs.is_floating_point(), probs.dtype
    spans = _row_spans(trees, probs, cu_rows)
    if not trees:
        return []
    plan, sampled = sample_packed(trees, probs, [lo for lo, _ in spans], generators, shared)
    return plan.acceptances(sampled.host_columns().cpu().numpy())  # host sync, the only one


def sample_packed(trees: Sequence[TokenTree], probs: torch.Tensor, firsts: Sequence[int],
                  generators: Sequence[torch.Generator | None],
                  shared: torch.Generator | None) -> tuple[TreePlan, SampledTrees]:
    """``sample_trees`` for trees whose roots are rows ``firsts`` of probs [R, vocab]: laid out, their draws taken
    (``draw_randoms``) and decided, on the probabilities' device and in their dtype, with no host sync."""
    plan = plan_trees(trees, firsts, probs.device, probs.dtype)
    uniforms, exponentials = draw_randoms(plan.sizes, probs.shape[1], generators, shared, probs.device, probs.dtype)
    return plan, sample_trees(probs, plan, uniforms, exponentials)


@dataclass(frozen=True)
class TreePlan:
    """B trees laid out for ``sample_trees``, built on the host and copied to the device once.

    A tree's slot 0 is its root (the pending token), slot 1 + i its node i; global node g = cu_nodes[b] + i, and
    g = G (one past the last node) stands for "no node" in every table (a dummy entry with an empty distribution)."""

    sizes: tuple[int, ...]  # [B] host: nodes per tree
    depth: int  # host: the deepest tree's levels
    width: int  # host: the most children of one node
    firsts: torch.Tensor  # [B] int64: the row of each tree's root in the packed probabilities
    cu_nodes: torch.Tensor  # [B] int64: each tree's first global node
    kids: torch.Tensor  # [B, S, C] int64: global node of slot s's c-th child (in index order), G past the last
    parent_rows: torch.Tensor  # [G] int64: the packed row of each node's parent (p of the node's token lives there)
    tokens: torch.Tensor  # [G + 1] int64
    q_token: torch.Tensor  # [G + 1] float: q(x_g), the draft's probability of the node's own token
    q_ids: torch.Tensor  # [G + 1, K] int64: the support of node g's draft distribution (padded with its first entry)
    q_vals: torch.Tensor  # [G + 1, K] float: q over that support (padding repeats the first entry's value)
    q_real: torch.Tensor  # [G + 1, K] bool: entries that are not padding
    branch_rows: torch.Tensor  # [M] int64: the packed rows of the nodes with two children or more
    branch_kids: torch.Tensor  # [M, C] int64: their children, G past the last

    def acceptances(self, columns: np.ndarray) -> list[Acceptance]:
        """The host's Acceptance per tree from ``SampledTrees.host_columns`` copied: [B * (2 + depth)]."""
        b = len(self.sizes)
        table = columns.reshape(b, 2 + self.depth).astype(np.int64)
        return [Acceptance(tuple(row[2 : 2 + row[0]].tolist()), int(row[1])) for row in table]


def plan_trees(trees: Sequence[TokenTree], firsts: Sequence[int], device: torch.device | str,
               dtype: torch.dtype) -> TreePlan:
    """The device layout of ``trees`` (root rows ``firsts``), vectorised over the batch on the host."""
    sizes = np.fromiter((tree.num_nodes for tree in trees), np.int64, len(trees))
    b, total = len(trees), int(sizes.sum())
    firsts = np.asarray(firsts, np.int64)
    cu = np.zeros(b + 1, np.int64)
    np.cumsum(sizes, out=cu[1:])
    tree_of = np.repeat(np.arange(b), sizes)  # [G]
    parent_slot = np.concatenate([tree.parents for tree in trees] + [np.zeros(0, np.int64)]) + 1
    depth = np.concatenate([tree.depth for tree in trees] + [np.zeros(0, np.int64)])
    slots = 1 + int(sizes.max(initial=0))
    # a node's rank among its siblings: nodes of one parent, in index order, after a stable sort by parent
    key = tree_of * slots + parent_slot
    order = np.argsort(key, kind="stable")
    rank = np.empty(total, np.int64)
    rank[order] = np.arange(total) - np.searchsorted(key[order], key[order])
    width = int(rank.max(initial=-1)) + 1
    kids = np.full((b, slots, max(width, 1)), total, np.int64)
    kids[tree_of, parent_slot, rank] = np.arange(total)
    # parents with a second child: their residual after each rejected child is what the next one is tested on
    branching = np.unique(key[rank == 1])
    branch_tree, branch_slot = branching // slots, branching % slots
    # draft distributions, padded to the widest: a tree without them has point masses on its tokens
    tokens = np.concatenate([tree.tokens for tree in trees] + [np.zeros(1, np.int64)])  # the dummy node's last
    ids, vals, counts = [], [], []
    for tree in trees:
        if tree.q_cu is None:
            ids.append(tree.tokens)
            vals.append(np.ones(tree.num_nodes))
            counts.append(np.ones(tree.num_nodes, np.int64))
        else:
            ids.append(tree.q_ids)
            vals.append(tree.q_probs)
            counts.append(np.diff(tree.q_cu))
    flat_ids, flat_vals = np.concatenate(ids + [np.zeros(0, np.int64)]), np.concatenate(vals + [np.zeros(0)])
    counts = np.concatenate(counts + [np.zeros(1, np.int64)])  # [G + 1]
    support = max(int(counts.max(initial=0)), 1)
    starts = np.zeros(total + 2, np.int64)
    np.cumsum(counts, out=starts[1:])
    head = starts[:-1].clip(max=max(len(flat_ids) - 1, 0))  # each node's first entry (the dummy: any, unused)
    q_ids = np.repeat((flat_ids[head] if len(flat_ids) else np.zeros(total + 1, np.int64))[:, None], support, 1)
    q_vals = np.repeat((flat_vals[head] if len(flat_vals) else np.zeros(total + 1))[:, None], support, 1)
    entry_node = np.repeat(np.arange(total + 1), counts)
    entry_pos = np.arange(len(flat_ids)) - np.repeat(starts[:-1], counts)
    q_ids[entry_node, entry_pos] = flat_ids
    q_vals[entry_node, entry_pos] = flat_vals
    q_real = np.zeros((total + 1, support), bool)
    q_real[entry_node, entry_pos] = True
    q_vals[total] = 0.0  # the dummy node: an empty distribution, nothing subtracted
    q_token = np.where(q_real & (q_ids == tokens[:, None]), q_vals, 0.0).sum(axis=1)

    # two host-to-device copies: every integer table in one buffer, every probability in another
    ints = [firsts, cu[:-1], kids, firsts[tree_of] + parent_slot, tokens, q_ids, q_real,
            firsts[branch_tree] + branch_slot, kids[branch_tree, branch_slot]]
    packed = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in ints]))
    packed = packed.to(device, non_blocking=True).split([a.size for a in ints])
    (firsts_d, cu_d, kids_d, parent_rows, tokens_d, q_ids_d, q_real_d, branch_rows, branch_kids) = (
        t.view(a.shape) for t, a in zip(packed, ints, strict=True))
    floats = torch.from_numpy(np.concatenate([q_token, q_vals.reshape(-1)])).to(device, dtype, non_blocking=True)
    return TreePlan(
        tuple(sizes.tolist()), int(depth.max(initial=-1)) + 1, width, firsts_d, cu_d, kids_d, parent_rows, tokens_d,
        floats[: total + 1], q_ids_d, floats[total + 1 :].view(q_vals.shape), q_real_d.bool(), branch_rows,
        branch_kids,
    )


def draw_randoms(sizes: Sequence[int], vocab: int, generators: Sequence[torch.Generator | None],
                 shared: torch.Generator | None, device: torch.device | str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [G]: one per node, exponentials [B, vocab]: one race per bonus token) for B trees of ``sizes``
    nodes. A tree with a generator draws from it alone, the same numbers whatever its batch; the others share one
    draw from ``shared``."""
    assert len(generators) == len(sizes), (len(generators), len(sizes))
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    common_u = torch.rand(sum(sizes[i] for i in unseeded), generator=shared, device=device, dtype=dtype)
    common_e = torch.empty(len(unseeded), vocab, device=device, dtype=dtype).exponential_(generator=shared)
    us, es, at, row = [], [], 0, 0
    for n, gen in zip(sizes, generators, strict=True):
        if gen is None:
            us.append(common_u[at : at + n])
            es.append(common_e[row : row + 1])
            at, row = at + n, row + 1
        else:
            us.append(torch.rand(n, generator=gen, device=device, dtype=dtype))
            es.append(torch.empty(1, vocab, device=device, dtype=dtype).exponential_(generator=gen))
    return torch.cat(us), torch.cat(es)


@dataclass(frozen=True)
class SampledTrees:
    """What ``sample_trees`` decided, on the device."""

    num_accepted: torch.Tensor  # [B] int64
    path: torch.Tensor  # [B, depth] int64: accepted nodes (tree-local), -1 past num_accepted
    bonus: torch.Tensor  # [B] int64: the token drawn after the path
    bonus_row: torch.Tensor  # [B] int64: the packed row the bonus was drawn from (its last accepted node's, or root's)
    bonus_probs: torch.Tensor  # [B, vocab] unnormalised: the distribution the bonus was drawn from

    def host_columns(self) -> torch.Tensor:
        """[B * (2 + depth)] float64: per tree (num_accepted, bonus, path...), what ``TreePlan.acceptances`` reads."""
        table = torch.cat([self.num_accepted[:, None], self.bonus[:, None], self.path], dim=1)
        return table.double().flatten()


def sample_trees(probs: torch.Tensor, plan: TreePlan, uniforms: torch.Tensor,
                 exponentials: torch.Tensor) -> SampledTrees:
    """``verify_sample``'s rule for every tree of ``plan`` at once, with no host sync.

    probs: [R, vocab] warped target distributions, the trees' rows as ``plan`` says; uniforms: [G], node g's
    acceptance draw; exponentials: [B, vocab] Exp(1) draws, the bonus token's race (argmax of p / E is a draw from
    p). The rule tries a node's children in index order: child c (token x) is accepted when u * q(x) < p_c(x),
    where p_c is the parent's row after its children 0..c-1 were rejected (p <- normalize(max(p - q, 0)) each),
    and the walk moves to the first accepted child. p_c depends only on the parent's row and its earlier
    children, not on the path that reached it, so every node's test is decided at once (the residuals of the
    nodes with several children kept unnormalised, written on q's support only: ``residual_sparse``); the walk is
    then a chase of "first accepted child" pointers, one gather per level. The bonus is drawn, by an exponential
    race, from the last node's row after all its children were rejected (a leaf: its row as is)."""
    b, g = len(plan.sizes), plan.tokens.shape[0] - 1
    device = probs.device
    if g == 0:  # empty trees only (plain decoding): the bonus alone, from each root's row
        p = probs[plan.firsts]
        return SampledTrees(torch.zeros(b, dtype=torch.int64, device=device), plan.kids.new_zeros(b, 0),
                            argmax_last(p / exponentials), plan.firsts, p)
    arange = torch.arange(b, device=device)
    # p_c(x) of every node: its parent's row as is for a first child, the residual after the earlier siblings else
    p_x = torch.cat([probs[plan.parent_rows, plan.tokens[:g]], probs.new_zeros(1)])  # [G + 1], the dummy last
    if plan.branch_rows.numel():
        p, total = probs[plan.branch_rows], probs.new_ones(plan.branch_rows.shape[0])  # [M, vocab], [M]
        for c in range(1, plan.width):
            before, child = plan.branch_kids[:, c - 1], plan.branch_kids[:, c]
            p, total = residual_sparse(p, total, plan.q_ids[before], plan.q_vals[before], plan.q_real[before],
                                       child < g)
            p_x = p_x.scatter(0, child, p.gather(1, plan.tokens[child][:, None])[:, 0] / total)  # G: the dummy's
    accept = uniforms.new_zeros(g + 1, dtype=torch.bool)
    accept[:g] = uniforms * plan.q_token[:g] < p_x[:g]  # u < min(1, p(x) / q(x)), without dividing
    # each slot's first accepted child, as the slot it leads to (-1: none)
    tried = accept[plan.kids]  # [B, S, C]
    first = plan.kids.gather(2, tried.to(torch.uint8).argmax(dim=2, keepdim=True))[..., 0]  # argmax: the first
    next_slot = torch.where(tried.any(dim=2), first - plan.cu_nodes[:, None] + 1, -1)  # [B, S]
    slot = torch.zeros(b, dtype=torch.int64, device=device)
    path = torch.full((b, plan.depth), -1, dtype=torch.int64, device=device)
    for level in range(plan.depth):  # a finished tree's slot has no accepted child: it stays where it is
        nxt = next_slot.gather(1, slot[:, None])[:, 0]
        path[:, level] = nxt - 1  # -1 - 1 < 0 past the end: cleaned below
        slot = torch.where(nxt >= 0, nxt, slot)
    path = torch.where(path >= 0, path, -1)
    # the bonus: the last node's row after its children's rejections
    bonus_row = plan.firsts + slot
    p, total = probs[bonus_row], probs.new_ones(b)
    for c in range(plan.width):
        child = plan.kids[arange, slot, c]
        p, total = residual_sparse(p, total, plan.q_ids[child], plan.q_vals[child], plan.q_real[child], child < g)
    bonus = argmax_last(p / exponentials)
    return SampledTrees((path >= 0).sum(dim=1), path, bonus, bonus_row, p)


def residual_sparse(p: torch.Tensor, total: torch.Tensor, q_ids: torch.Tensor, q_vals: torch.Tensor,
                    q_real: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual`` for the rows of ``rejected`` [B]: p [B, vocab] unnormalised with its totals [B], q sparse
    (q_ids, q_vals, q_real: [B, K]). max(p / total - q, 0) changes only q's support, so the new unnormalised p is
    max(p - total * q, 0) there, and the new total is the old less what those entries lost. A residual with no
    mass left (p == q up to rounding: the child would have been accepted surely) keeps p, as ``residual`` does.
    Updates p in place; returns (p, total)."""
    old = p.gather(1, q_ids)
    new = (old - total[:, None] * q_vals).clamp(min=0.0)
    left = total - ((old - new) * q_real).sum(dim=1)
    ok = rejected & (left > total * 4 * torch.finfo(p.dtype).eps)
    p.scatter_(1, q_ids, torch.where(ok[:, None], new, old))  # padding repeats an entry: the same value written
    return p, torch.where(ok, left, total)


def _walk_sample(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [num_nodes + 1, vocab] float64, on the device
    uniforms: np.ndarray,  # [num_nodes] float64: node i's acceptance draw
    p_tokens: np.ndarray,  # [num_nodes] float64: p(x_i) in the row of i's parent, before any rejection there
) -> tuple[list[int], torch.Tensor]:
    """verify_sample's walk on the host: (accepted path, bonus token's distribution [vocab] on the device)."""
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        rejected = False  # once a child is rejected here, p is a residual that lives only on the device
        chosen = None
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            q_ids, q_vals = tree.draft_dist(child)
            q_x = float(q_vals[q_ids == x][0])
            p_x = float(p[x]) if rejected else float(p_tokens[child])  # host sync only after a rejection
            if uniforms[child] * q_x < p_x:  # u < min(1, p_x / q_x), without dividing
                chosen = child
                break
            p = residual(p, torch.as_tensor(q_ids, device=p.device),
                         torch.as_tensor(q_vals, dtype=torch.float64, device=p.device))
            rejected = True
        if chosen is None:
            return accepted, p
        accepted.append(chosen)
        node = chosen


def _row_spans(
    trees: Sequence[TokenTree], packed: torch.Tensor, cu_rows: Sequence[int]
) -> list[tuple[int, int]]:
    """(start, end) row of each tree in ``packed`` [total_rows, vocab]; asserts the packing fits the trees."""
    cu = [int(c) for c in cu_rows]
    assert packed.ndim == 2, packed.shape
    assert len(cu) == len(trees) + 1 and cu[0] == 0 and cu[-1] == packed.shape[0], (cu, packed.shape)
    spans = list(pairwise(cu))
    for tree, (lo, hi) in zip(trees, spans, strict=True):
        assert hi - lo == tree.num_nodes + 1, (hi - lo, tree.num_nodes)
    return spans
