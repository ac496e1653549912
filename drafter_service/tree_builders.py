"""Building candidate trees: the ways proposers assemble a TokenTree.

- ``TreeBuilder``: grow a tree node by node, merging duplicate (parent, token) children
  (prompt lookup, copy, token recycling);
- ``best_paths_tree``: keep the best-scoring nodes of a trie (fusion, retrieval);
- ``weighted_paths_tree``: a trie of weighted continuations, each node's draft probability
  its share of the evidence at its parent (retrieval).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specmesh.tree import TokenTree


class TreeBuilder:
    """Grows a tree node by node, merging duplicate (parent, token) children."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.sources: list[str] = []
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, parent: int, token: int) -> int | None:
        return self._index.get((parent, token))

    def add(self, parent: int, token: int, prob: float = 1.0, source: str = "") -> int:
        """Add a child of ``parent`` (-1 = root) unless it exists; return its index."""
        key = (parent, int(token))
        found = self._index.get(key)
        if found is not None:
            return found
        self._index[key] = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(float(prob))
        self.sources.append(source)
        return len(self.tokens) - 1

    def add_path(self, tokens: Sequence[int], source: str = "", parent: int = -1, max_nodes: int | None = None) -> int:
        """Add a chain below ``parent``, sharing existing prefixes; stops at ``max_nodes``. Returns the last node.
        (``add``'s work inlined: proposers call it for every token of every step's trees.)"""
        index, toks, parents, probs, sources = self._index, self.tokens, self.parents, self.probs, self.sources
        limit = len(toks) + len(tokens) if max_nodes is None else max_nodes
        node = parent
        for tok in tokens:
            key = (node, int(tok))
            child = index.get(key)
            if child is None:
                if len(toks) >= limit:
                    break
                child = index[key] = len(toks)
                toks.append(key[1])
                parents.append(node)
                probs.append(1.0)
                sources.append(source)
            node = child
        return node

    def build(self) -> TokenTree:
        return TokenTree(
            np.asarray(self.tokens, np.int64),
            np.asarray(self.parents, np.int64),
            np.asarray(self.probs, np.float64),
            tuple(self.sources),
        )


def weighted_paths_tree(paths: Sequence[tuple[Sequence[int], float]], max_nodes: int, max_depth: int,
                        source: str = "", min_share: float = 0.0) -> TokenTree:
    """A tree from weighted token paths (e.g. continuations with their counts): the paths are merged
    into a trie, each node weighing the total of the paths through it, and the ``max_nodes`` heaviest
    nodes no deeper than ``max_depth`` are kept (a node never outweighs its parent, so every kept
    node's parent is kept). A node's draft probability is its weight over its parent's: the share of
    the evidence at the parent that continues with it. Nodes whose share of all the evidence is
    below ``min_share`` are left out (SpecDec++'s stop rule, ``Budget.min_path_prob``)."""
    weight: dict[tuple[int, ...], float] = {}  # in first-seen order
    for tokens, w in paths:
        for d in range(1, min(len(tokens), max_depth) + 1):
            key = tuple(int(t) for t in tokens[:d])
            weight[key] = weight.get(key, 0.0) + float(w)
    total = sum(w for key, w in weight.items() if len(key) == 1)
    if max_nodes <= 0 or total <= 0:
        return TokenTree.empty()
    scored = {key: (w, w / (total if len(key) == 1 else weight[key[:-1]]), source) for key, w in weight.items()}
    return best_paths_tree(scored, max_nodes, min_share * total)


def best_paths_tree(paths: dict[tuple[int, ...], tuple[float, float, str]], max_nodes: int,
                    min_score: float = 0.0) -> TokenTree:
    """The tree of the ``max_nodes`` best-scoring nodes of a trie, none scoring below ``min_score``.

    ``paths``: token path from the root -> (score, draft probability, source), every prefix of a path
    present and scoring at least as much as the path (so every kept node's parent is kept). Ties go
    to the shallower node, then the one inserted first; nodes are numbered parents first."""
    order = {key: i for i, key in enumerate(paths)}
    ranked = sorted(paths, key=lambda key: (-paths[key][0], len(key), order[key]))
    kept = [key for key in ranked if paths[key][0] >= min_score][:max_nodes]
    kept.sort(key=lambda key: (len(key), order[key]))
    builder = TreeBuilder()
    index: dict[tuple[int, ...], int] = {}
    for key in kept:
        _, prob, source = paths[key]
        index[key] = builder.add(index[key[:-1]] if len(key) > 1 else -1, key[-1], prob, source)
    return builder.build()
