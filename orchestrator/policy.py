"""Speculation policies: how big a tree to ask the drafter for in the next step.

The engine asks for a budget in one of three phases:

- ``sequential``: plain draft-then-verify; the verifier waits while this tree is drafted.
- ``restart``: overlapped (PEARL) loop, but nothing drafted ahead could be used, so the
  verifier waits for this tree. A short draft here is PEARL's pre-verify: the verifier
  starts on the first token(s) while the drafter drafts on behind them.
- ``predraft``: drafted while the verifier checks the current tree; its cost is hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol

from drafter_service.proposer import Budget
from orchestrator.stats import RequestStats

Phase = Literal["sequential", "restart", "predraft"]


class SpeculationPolicy(Protocol):
    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget: ...


def depth_limit(max_depth: int, remaining_tokens: int) -> int:
    """Every step commits a bonus token after the accepted path: never draft past the end."""
    return max(0, min(max_depth, remaining_tokens - 1))


def deadline_in(seconds: float | None) -> float | None:
    return time.monotonic() + seconds if seconds else None


@dataclass(frozen=True)
class StaticPolicy:
    """The same budget every step (0 nodes = plain autoregressive decoding)."""

    max_nodes: int = 8
    max_depth: int = 8
    draft_timeout_s: float | None = None
    restart_depth: int | None = None  # depth of a ``restart`` draft (pre-verify); None = max_depth

    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget:
        nodes, depth = self.max_nodes, self.max_depth
        if phase == "restart" and self.restart_depth is not None and self.restart_depth < depth:
            # a shallower tree keeps the same share of nodes per level
            nodes, depth = max(self.restart_depth, nodes * self.restart_depth // depth), self.restart_depth
        depth = depth_limit(depth, remaining_tokens)
        return Budget(nodes if depth else 0, depth, deadline_in(self.draft_timeout_s))
