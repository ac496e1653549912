"""TokenTree: the candidate tree a drafter proposes and a verifier checks.

Flat arrays, node 0 first. ``parents[i] == -1`` means node i is a child of the
last committed token (the tree's implicit root); otherwise ``parents[i] < i``,
which makes cycles impossible by construction and lets every derived quantity
be computed in one forward pass over the nodes.

Draft distributions (needed only for lossless sampling) are stored sparse, in
CSR form: node i's token was drawn from the distribution
``q_ids[q_cu[i]:q_cu[i+1]] -> q_probs[...]``, *conditioned on the siblings that
come before it* (so i.i.d. sampling repeats one q, sampling without replacement
renormalises, and a deterministic pick is a point mass). A tree without
distributions (``q_cu is None``) means every node is a deterministic pick: the
verifier then uses the point-mass rule, which keeps the target distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# the largest tree a verifier takes (`--max-tree-nodes`' default, the embedded stack's verifier's): the one place
# the number is written
MAX_TREE_NODES = 256
HOST_CHECK_BELOW = 64  # trees of fewer nodes have their elements checked on the host (TokenTree.validate)
_NOT_NEGATIVE = (0.0).__le__  # q >= 0 (False for NaN)
_AT_MOST_ONE = (1 + 1e-6).__ge__  # q <= 1, with float rounding


class InvalidTreeError(ValueError):
    """A tree breaks the TokenTree contract (bad parent, id out of vocab, NaN...)."""


@dataclass(frozen=True, eq=False)
class TokenTree:
    tokens: np.ndarray  # [num_nodes] int64
    parents: np.ndarray  # [num_nodes] int64, -1 = child of the last committed token
    draft_probs: np.ndarray  # [num_nodes] float64, q(token_i | path to parent, earlier siblings)
    sources: tuple[str, ...] = ()  # [num_nodes] proposer name per node
    q_cu: np.ndarray | None = None  # [num_nodes + 1] int64 CSR offsets into q_ids/q_probs
    q_ids: np.ndarray | None = None  # [nnz] int64
    q_probs: np.ndarray | None = None  # [nnz] float64

    # ------------------------------------------------------------------ build
    @staticmethod
    def empty() -> TokenTree:
        return TokenTree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64), ())

    @staticmethod
    def chain(tokens: Sequence[int], draft_probs: Sequence[float] | None = None, source: str = "") -> TokenTree:
        n = len(tokens)
        probs = np.ones(n) if draft_probs is None else np.asarray(draft_probs, np.float64)
        return TokenTree(
            np.asarray(tokens, np.int64).reshape(n),
            np.arange(-1, n - 1, dtype=np.int64),
            probs.reshape(n),
            (source,) * n,
        )

    @cached_property
    def num_nodes(self) -> int:  # read several times per tree and step: computed once
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def has_draft_dists(self) -> bool:
        return self.q_cu is not None

    # ---------------------------------------------------------------- derived
    @cached_property
    def is_chain(self) -> bool:
        """Every node is the child of the one before it (the empty tree included): one line of tokens."""
        n = self.num_nodes
        if n < HOST_CHECK_BELOW:  # a small tree's parents compared on the host: a third of numpy's two calls
            return self.parents.tolist() == list(range(-1, n - 1))
        return bool((self.parents == np.arange(-1, n - 1)).all())

    @cached_property
    def depth(self) -> np.ndarray:
        """[num_nodes] int64; children of the root have depth 0."""
        if self.is_chain:
            return np.arange(self.num_nodes, dtype=np.int64)
        depth: list[int] = []
        for i, p in enumerate(self.parents.tolist()):  # a parent after its child (an invalid tree) reads as depth 0
            depth.append(0 if p < 0 else (depth[p] if p < i else 0) + 1)
        return np.asarray(depth, np.int64).reshape(self.num_nodes)

    @property
    def max_depth(self) -> int:
        """Nodes on the longest root-to-leaf path."""
        if self.is_chain:
            return self.num_nodes
        return int(self.depth.max()) + 1 if self.num_nodes else 0

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[num_nodes, num_nodes] bool; mask[i, j] = j is i or an ancestor of i."""
        return ancestor_mask(self.parents.tolist())

    def path_ranks(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """Rank of each of ``nodes`` among the tree's nodes by path probability (the product of the draft
        probabilities from the root down to the node), most probable first; ties go to the shallower node,
        then the lower index. Best-first drafters keep the top ranks of a larger tree (a child never ranks
        above its parent, as its path probability is at most its parent's), so rank k is the (k+1)-th node
        a budget buys. A chain's ranks are its node indices."""
        if not nodes:
            return ()
        if self.is_chain and bool((self.draft_probs <= 1.0).all()):
            return tuple(int(i) for i in nodes)
        path = self.draft_probs.astype(np.float64)  # parents come first: one pass
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                path[i] *= path[p]
        order = np.lexsort((np.arange(self.num_nodes), self.depth, -path))
        rank = np.empty(self.num_nodes, np.int64)
        rank[order] = np.arange(self.num_nodes)
        return tuple(int(rank[i]) for i in nodes)

    def position_ids(self, prefix_len: int) -> np.ndarray:
        """[num_nodes]; ``prefix_len`` counts every committed token, including the last one."""
        return prefix_len + self.depth

    @cached_property
    def children(self) -> list[list[int]]:
        """children[0] = root's children; children[i + 1] = node i's children, in index order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    def children_of(self, node: int) -> list[int]:
        """Children of ``node`` (-1 = the root)."""
        return self.children[node + 1]

    @cached_property
    def leaves(self) -> list[int]:
        return [i for i in range(self.num_nodes) if not self.children[i + 1]]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        return [self.path_to(leaf) for leaf in self.leaves]

    def main_path(self) -> list[int]:
        """Node indices of the tree's most likely line: from the root, always the child with the
        highest draft probability (the first such child on ties), down to a leaf."""
        path: list[int] = []
        kids = self.children_of(-1)
        while kids:
            best = max(kids, key=lambda c: self.draft_probs[c])  # max keeps the first of equals
            path.append(best)
            kids = self.children_of(best)
        return path

    def subtree(self, node: int) -> TokenTree:
        """The descendants of ``node`` as a tree of their own: node's children become the root's.

        Used when ``node``'s token has just been committed, so what was drafted below it is a
        draft for the new context. Node order, draft probabilities, sources and draft
        distributions are kept."""
        n = self.num_nodes
        if not 0 <= node < n:
            raise IndexError(f"node {node} is not in a tree of {n} nodes")
        if n < HOST_CHECK_BELOW:  # a small tree's descendants in one pass on the host (parents come first)
            new_index = {node: -1}  # old index -> new one, for node and its descendants
            keep_list, parent_list = [], []
            for i, p in enumerate(self.parents[node + 1 :].tolist(), node + 1):
                if p in new_index:
                    new_index[i] = len(keep_list)
                    keep_list.append(i)
                    parent_list.append(new_index[p])
            keep, parents = np.array(keep_list, np.int64), np.array(parent_list, np.int64)
        else:
            below = self.ancestor_mask[:, node].copy()
            below[node] = False
            keep = np.flatnonzero(below)
            index = np.full(n, -1, np.int64)
            index[keep] = np.arange(keep.size)
            parents = self.parents[keep]
            parents = np.where(parents == node, -1, index[np.maximum(parents, 0)])
        q_cu = q_ids = q_probs = None
        if self.q_cu is not None:
            spans = [np.arange(self.q_cu[i], self.q_cu[i + 1]) for i in keep]
            picked = np.concatenate(spans) if spans else np.zeros(0, np.int64)
            q_cu = np.concatenate([[0], np.cumsum([len(x) for x in spans])]).astype(np.int64)
            q_ids, q_probs = self.q_ids[picked], self.q_probs[picked]
        return TokenTree(
            self.tokens[keep], parents.astype(np.int64), self.draft_probs[keep],
            tuple(self.sources[i] for i in keep) if self.sources else (), q_cu, q_ids, q_probs,
        )

    def select(self, keep: np.ndarray) -> TokenTree:
        """The nodes where ``keep`` [num_nodes] bool is set, as a tree: every kept node's parent must be kept (or be
        the root). Node order, draft probabilities, sources and draft distributions are kept."""
        nodes = np.flatnonzero(keep)
        if nodes.size == self.num_nodes:
            return self
        new_index = np.full(self.num_nodes, -1, np.int64)
        new_index[nodes] = np.arange(nodes.size)
        parents = self.parents[nodes]
        parents = np.where(parents < 0, -1, new_index[np.maximum(parents, 0)])
        if (parents[self.parents[nodes] >= 0] < 0).any():
            raise ValueError("select: a kept node's parent is dropped")
        q_cu = q_ids = q_probs = None
        if self.q_cu is not None:
            spans = [np.arange(self.q_cu[i], self.q_cu[i + 1]) for i in nodes]
            picked = np.concatenate(spans) if spans else np.zeros(0, np.int64)
            q_cu = np.concatenate([[0], np.cumsum([len(x) for x in spans])]).astype(np.int64)
            q_ids, q_probs = self.q_ids[picked], self.q_probs[picked]
        return TokenTree(
            self.tokens[nodes], parents.astype(np.int64), self.draft_probs[nodes],
            tuple(self.sources[i] for i in nodes) if self.sources else (), q_cu, q_ids, q_probs,
        )

    def head(self, num_nodes: int) -> TokenTree:
        """The first ``num_nodes`` nodes: still a tree, since every parent comes before its children."""
        if num_nodes >= self.num_nodes:
            return self
        k = max(0, num_nodes)
        q_cu = q_ids = q_probs = None
        if self.q_cu is not None:
            q_cu = self.q_cu[: k + 1]
            q_ids, q_probs = self.q_ids[: q_cu[-1]], self.q_probs[: q_cu[-1]]
        return TokenTree(self.tokens[:k], self.parents[:k], self.draft_probs[:k], self.sources[:k], q_cu, q_ids, q_probs)

    def draft_dist(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probs) of the distribution node's token was drawn from; a point mass if none shipped."""
        if self.q_cu is None:
            return self.tokens[node : node + 1], np.ones(1)
        lo, hi = int(self.q_cu[node]), int(self.q_cu[node + 1])
        return self.q_ids[lo:hi], self.q_probs[lo:hi]

    # ------------------------------------------------------------- validation
    def validate(self, vocab_size: int, max_nodes: int | None = None, max_depth: int | None = None) -> TokenTree:
        """Raise InvalidTreeError unless the tree keeps the contract; returns self. A tree is a value: its arrays are
        not changed after it is built, so the checks of its elements run once per vocabulary size (a tree the
        drafter link checked is not walked again by the verifier); the limits are checked at every call."""
        n = self.num_nodes
        if n == 0 and self.__dict__.get("_valid_empty") and (max_nodes is None or max_nodes >= 0):
            return self  # an empty tree passed once (no element can change): every plain step's shared tree
        if n and self.__dict__.get("_valid_vocab") == vocab_size:
            if max_nodes is not None and n > max_nodes:
                raise InvalidTreeError(f"tree has {n} nodes, more than the limit {max_nodes}")
            if max_depth is not None and self.max_depth > max_depth:
                raise InvalidTreeError(f"tree depth {self.max_depth} exceeds the limit {max_depth}")
            return self
        for name in ("tokens", "parents", "draft_probs"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.shape[0] != n:
                raise InvalidTreeError(f"{name} must be a 1-D array of length num_nodes={n}")
        for name in ("tokens", "parents"):  # dtype.kind: np.issubdtype's answer at a tenth of its cost
            if getattr(self, name).dtype.kind not in "iu":
                raise InvalidTreeError(f"{name} must be an integer array, got dtype {getattr(self, name).dtype}")
        if self.draft_probs.dtype.kind != "f":
            raise InvalidTreeError(f"draft_probs must be a float array, got dtype {self.draft_probs.dtype}")
        if self.sources and len(self.sources) != n:
            raise InvalidTreeError(f"sources has {len(self.sources)} entries for {n} nodes")
        if max_nodes is not None and n > max_nodes:
            raise InvalidTreeError(f"tree has {n} nodes, more than the limit {max_nodes}")
        if n == 0:
            self.__dict__["_valid_empty"] = True  # frozen: the instance dict, as cached_property does
            return self
        # a proposer's every tree is checked once: a small one's elements on the host (numpy's eight reductions
        # cost ~3x that walk), a large one's in one pass each with no temporary where it can
        if n < HOST_CHECK_BELOW:  # (builtins mapped over lists: no Python frame per node)
            tokens, parents, probs = self.tokens.tolist(), self.parents.tolist(), self.draft_probs.tolist()
            parents_ok = min(parents) >= -1 and all(map(int.__lt__, parents, range(n)))
            tokens_ok = min(tokens) >= 0 and max(tokens) < vocab_size
            # NaN fails both comparisons
            probs_ok = all(map(_NOT_NEGATIVE, probs)) and all(map(_AT_MOST_ONE, probs))
        else:
            parents_ok = self.parents.min() >= -1 and (self.parents < np.arange(n)).all()
            tokens_ok = self.tokens.min() >= 0 and self.tokens.max() < vocab_size
            low, high = self.draft_probs.min(), self.draft_probs.max()  # NaN propagates: it fails both comparisons
            probs_ok = low >= 0 and high <= 1 + 1e-6
        if not parents_ok:
            i = int(np.flatnonzero((self.parents < -1) | (self.parents >= np.arange(n)))[0])
            raise InvalidTreeError(f"node {i} has parent {int(self.parents[i])}; parents[i] must be in [-1, i)")
        if not tokens_ok:
            i = int(np.flatnonzero((self.tokens < 0) | (self.tokens >= vocab_size))[0])
            raise InvalidTreeError(f"node {i} has token id {int(self.tokens[i])} outside the vocabulary [0, {vocab_size})")
        if not probs_ok:
            raise InvalidTreeError("draft_probs must be finite probabilities in [0, 1]")
        if max_depth is not None and self.max_depth > max_depth:
            raise InvalidTreeError(f"tree depth {self.max_depth} exceeds the limit {max_depth}")
        if self.q_cu is not None:
            self._validate_dists(vocab_size)
        self.__dict__["_valid_vocab"] = vocab_size  # frozen: the instance dict, as cached_property does
        return self

    def _validate_dists(self, vocab_size: int) -> None:
        n = self.num_nodes
        q_cu, q_ids, q_probs = self.q_cu, self.q_ids, self.q_probs
        if q_ids is None or q_probs is None or q_cu.shape != (n + 1,) or q_ids.shape != q_probs.shape:
            raise InvalidTreeError("draft distributions need q_cu [num_nodes+1] and equal-length q_ids, q_probs")
        if not (np.issubdtype(q_cu.dtype, np.integer) and np.issubdtype(q_ids.dtype, np.integer)):
            raise InvalidTreeError("q_cu and q_ids must be integer arrays")
        if q_cu[0] != 0 or q_cu[-1] != q_ids.shape[0] or (np.diff(q_cu) < 1).any():
            raise InvalidTreeError("q_cu must start at 0, end at nnz and give every node a non-empty distribution")
        if ((q_ids < 0) | (q_ids >= vocab_size)).any():
            raise InvalidTreeError("draft distribution names a token id outside the vocabulary")
        if not np.isfinite(q_probs).all() or (q_probs < 0).any():
            raise InvalidTreeError("draft distribution probabilities must be finite and non-negative")
        sums = np.add.reduceat(q_probs, q_cu[:-1])
        if (np.abs(sums - 1.0) > 1e-3).any():
            raise InvalidTreeError("every draft distribution must sum to 1")
        for i in range(n):
            ids, probs = self.draft_dist(i)
            hit = probs[ids == self.tokens[i]]
            if hit.size != 1 or hit[0] <= 0:
                raise InvalidTreeError(f"node {i}'s token must appear once, with positive probability, in its draft distribution")


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[n, n] bool for a forest given by ``parents`` (-1 = root, parents[i] < i): mask[i, j] = j is i or an ancestor."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask
