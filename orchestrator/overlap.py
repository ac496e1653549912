"""Pieces of the overlapped (PEARL) loop: the drafter's view of the context, a
background draft worker, and the rule that decides whether drafted-ahead work is used.

While the verifier checks tree t, the drafter drafts on the assumption that t's main
line (``TokenTree.main_path``) is accepted whole. The tree it drafts then starts one
level early: its root children are guesses of the bonus token the verifier will add
after that line. If the verifier accepts exactly the main line and its bonus token is
one of those guesses, the guess's subtree is a draft for the new context and is
verified next without waiting for the drafter; otherwise it is dropped and the
drafter is rolled back to the verified context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from drafter_service.drafter import Drafter, common_prefix_len
from drafter_service.proposer import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree


@dataclass
class DraftContext:
    """What a drafter session holds, as seen by the engine: the committed tokens up to
    ``mark`` (counted after the prompt), followed by ``tail``, which is either committed
    tokens it has not been told about yet or a hypothesis it drafted ahead on."""

    mark: int = 0
    tail: list[int] = field(default_factory=list)

    def edit(self, committed: Sequence[int], hypothesis: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(rollback, new_tokens) that bring the drafter to ``committed + hypothesis``; records it.
        ``committed`` is every token committed after the prompt."""
        target = list(committed[self.mark :]) + list(hypothesis)
        keep = common_prefix_len(self.tail, target)
        rollback, append = len(self.tail) - keep, target[keep:]
        self.mark, self.tail = len(committed), list(hypothesis)
        return rollback, append


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


def predraft_budget(budget: Budget, stop, levels: int = 1, max_nodes: int | None = None) -> Budget:
    """Budget for drafting ahead: ``levels`` more than the next tree (the levels the step will
    commit: the bonus token, plus the main line when drafting from the context), within ``max_nodes``."""
    per_level = max(1, budget.max_nodes // max(budget.max_depth, 1))
    nodes = budget.max_nodes + per_level * levels
    if max_nodes is not None:
        nodes = min(nodes, max_nodes)
    return Budget(nodes, budget.max_depth + levels, budget.deadline, budget.min_path_prob, stop)


class DraftWorker:
    """Runs every call to one drafter on a single background thread, in submission order,
    so drafting overlaps the verifier's work on the caller's thread. A drafter is never
    called from two threads at once."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft-worker")

    def propose(self, session_id: str, new_tokens: Sequence[int], budget: Budget, rollback: int,
                feedback: DraftFeedback | None = None) -> Future:
        """Future of (tree, seconds the drafter worked on it)."""
        return self._pool.submit(self._timed, session_id, list(new_tokens), budget, rollback, feedback)

    def _timed(self, session_id: str, new_tokens: list[int], budget: Budget, rollback: int,
               feedback: DraftFeedback | None) -> tuple[TokenTree, float]:
        t0 = time.perf_counter()
        tree = self.drafter.propose(session_id, new_tokens, budget, rollback, feedback)
        return tree, time.perf_counter() - t0

    def submit(self, method: str, *args) -> Future:
        """Queue another drafter method (open, close) on the worker, after what is queued."""
        return self._pool.submit(getattr(self.drafter, method), *args)

    def call(self, method: str, *args):
        """``submit`` and wait for it."""
        return self.submit(method, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
