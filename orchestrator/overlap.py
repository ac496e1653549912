"""Pieces of the overlapped (PEARL) loop: how much to draft ahead, and the rule that decides
whether drafted-ahead work is used (the drafter's view of the context and the background
worker are the drafter link's: orchestrator/drafter_link.py).

While the verifier checks tree t, the drafter drafts on the assumption that t's main
line (``TokenTree.main_path``) is accepted whole. The tree it drafts then starts one
level early: its root children are guesses of the bonus token the verifier will add
after that line. If the verifier accepts exactly the main line and its bonus token is
one of those guesses, the guess's subtree is a draft for the new context and is
verified next without waiting for the drafter; otherwise it is dropped and the
drafter is rolled back to the verified context.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.contract import Budget
from specmesh.tree import TokenTree


def reusable_subtree(
    pre_tree: TokenTree, hypothesis: Sequence[int], committed: Sequence[int], max_nodes: int
) -> TokenTree | None:
    """The part of a tree drafted ahead from the context + ``hypothesis`` that is a draft for the
    context after this step committed ``committed`` (accepted tokens + bonus): the subtree below
    the node whose path spells what was committed beyond the hypothesis, cut to ``max_nodes``.
    None if the step did not confirm the hypothesis, the tree has no such node, or nothing is below it."""
    if len(committed) <= len(hypothesis) or list(committed[: len(hypothesis)]) != list(hypothesis):
        return None
    node = -1
    for token in committed[len(hypothesis):]:
        node = next((c for c in pre_tree.children_of(node) if int(pre_tree.tokens[c]) == token), -2)
        if node == -2:
            return None
    sub = pre_tree.subtree(node).head(max_nodes)
    return sub if sub.num_nodes else None


def predraft_budget(budget: Budget, stop, levels: int = 1) -> Budget:
    """Budget for drafting ahead: ``levels`` more than the next tree (the levels the step will
    commit: the bonus token, plus the main line when drafting from the context). The part of it
    verified later is cut to the next tree's budget (``reusable_subtree``); a drafter caps the rest
    at its own capacity."""
    per_level = max(1, budget.max_nodes // max(budget.max_depth, 1))
    return Budget(budget.max_nodes + per_level * levels, budget.max_depth + levels, budget.deadline,
                  budget.min_path_prob, stop)
