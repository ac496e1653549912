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
  x_c out of p and renormalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specmesh.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: tuple[int, ...]  # node indices along the accepted path, root's child first
    bonus_token: int  # the target's own token after the accepted path

    def tokens(self, tree: TokenTree) -> list[int]:
        """Accepted draft tokens followed by the bonus token."""
        return [int(tree.tokens[i]) for i in self.accepted_nodes] + [self.bonus_token]


def verify_greedy(tree: TokenTree, target_argmax: np.ndarray) -> Acceptance:
    """target_argmax: [num_nodes + 1] int, the target's argmax at the root and at each node."""
    assert target_argmax.shape == (tree.num_nodes + 1,), target_argmax.shape
    tokens = tree.tokens
    accepted: list[int] = []
    node = -1
    while True:
        want = int(target_argmax[node + 1])
        nxt = next((c for c in tree.children_of(node) if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(tuple(accepted), want)
        accepted.append(nxt)
        node = nxt


def verify_sample(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """target_probs: [num_nodes + 1, vocab] float64, warped target distributions (sum to 1 per row)."""
    assert target_probs.ndim == 2 and target_probs.shape[0] == tree.num_nodes + 1, target_probs.shape
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        chosen = None
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            q_ids, q_vals = tree.draft_dist(child)
            q_x = float(q_vals[q_ids == x][0])
            p_x = float(p[x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * q_x < p_x:  # u < min(1, p_x / q_x), without dividing
                chosen = child
                break
            p = residual(p, torch.as_tensor(q_ids), torch.as_tensor(q_vals, dtype=torch.float64))
        if chosen is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Acceptance(tuple(accepted), bonus)
        accepted.append(chosen)
        node = chosen


def residual(p: torch.Tensor, q_ids: torch.Tensor, q_vals: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) for a dense p [vocab] and a sparse q (q_ids, q_vals: [nnz])."""
    r = p.clone()
    r.index_add_(0, q_ids.long(), -q_vals)
    r.clamp_(min=0.0)
    total = r.sum()
    if total <= 0:  # p == q up to rounding: the child would have been accepted surely
        return p
    return r / total
