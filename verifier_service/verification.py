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
- ``verify_sample_batch``: the rule of ``verify_sample``, with the device work done up
  front for all requests (in the style of vLLM's rejection sampler): each request's
  uniforms drawn in one call with its own generator, p(x_i) of every node read from its
  parent's row by one gather, both copied to the host at once. The tree walk runs on the
  host; the device is read again only after a rejection has changed p at a node (the
  residual). The bonus tokens are drawn on the device and copied at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

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
    """log p(x_i | ...) of every node of every tree: tree r's outputs are rows [firsts[r], firsts[r] + num_nodes + 1)
    of logits [R, vocab] (any device), row 0 the root's; node i's token is read from its parent's row. One log-softmax
    over the parents' rows (float64), one gather and one host copy for all trees. Returns [num_nodes] per tree."""
    rows = np.concatenate([first + 1 + tree.parents for tree, first in zip(trees, firsts, strict=True)] + [[]])
    cols = np.concatenate([tree.tokens for tree in trees] + [[]])
    if not len(rows):
        return [np.zeros(0) for _ in trees]
    index = torch.from_numpy(rows.astype(np.int64)).to(logits.device)
    picked = logits[index].double()  # [total_nodes, vocab]
    logp = picked.gather(1, torch.from_numpy(cols.astype(np.int64)).to(logits.device)[:, None])[:, 0]
    logp = (logp - torch.logsumexp(picked, dim=-1)).cpu().numpy()  # [total_nodes]; host sync
    cu = np.cumsum([0] + [tree.num_nodes for tree in trees])
    return [logp[a:b] for a, b in pairwise(cu)]


def verify_sample(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """target_probs: [num_nodes + 1, vocab] float64, warped target distributions (sum to 1 per row).
    A batch of one for ``verify_sample_batch``, whose walk is the rule described above."""
    return verify_sample_batch([tree], target_probs, [0, tree.num_nodes + 1], [generator])[0]


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
    target_argmax = logits.argmax(dim=-1).cpu().numpy()  # [total_rows]; host sync, the only one
    return [verify_greedy(tree, target_argmax[lo:hi]) for tree, (lo, hi) in zip(trees, spans, strict=True)]


def verify_sample_batch(
    trees: Sequence[TokenTree],
    probs: torch.Tensor,  # [total_rows, vocab] float64, warped target distributions (sum to 1 per row)
    cu_rows: Sequence[int],  # [num_trees + 1], tree r owns rows cu_rows[r]:cu_rows[r + 1]
    generators: Sequence[torch.Generator | None],  # [num_trees] on probs.device; request r uses only its own
) -> list[Acceptance]:
    """``verify_sample`` for every tree, with the same output law (not the same random stream)."""
    assert probs.dtype == torch.float64, probs.dtype
    assert len(generators) == len(trees), (len(generators), len(trees))
    spans = _row_spans(trees, probs, cu_rows)
    if not trees:
        return []
    device = probs.device
    # one uniform per node, one call per request: a seeded request's draws do not depend on its batch
    uniforms = torch.cat([
        torch.rand(tree.num_nodes, generator=gen, device=device, dtype=torch.float64)
        for tree, gen in zip(trees, generators, strict=True)
    ])  # [total_nodes]
    # p(x_i) of every node's token, read from its parent's row
    rows = np.concatenate([lo + 1 + tree.parents for tree, (lo, _) in zip(trees, spans, strict=True)])
    cols = np.concatenate([tree.tokens for tree in trees])  # rows, cols: [total_nodes]
    p_tokens = probs[torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)]  # [total_nodes]
    uniforms_host, p_tokens_host = torch.stack([uniforms, p_tokens]).cpu().numpy()  # host sync
    cu_nodes = np.cumsum([0] + [tree.num_nodes for tree in trees])  # [num_trees + 1]
    walks = [
        _walk_sample(tree, probs[lo:hi], uniforms_host[a:b], p_tokens_host[a:b])
        for tree, (lo, hi), a, b in zip(trees, spans, cu_nodes[:-1], cu_nodes[1:], strict=True)
    ]
    bonus = torch.cat([
        torch.multinomial(bonus_p, 1, generator=gen)
        for (_, bonus_p), gen in zip(walks, generators, strict=True)
    ]).tolist()  # [num_trees]; host sync
    return [Acceptance(tuple(accepted), token) for (accepted, _), token in zip(walks, bonus, strict=True)]


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
