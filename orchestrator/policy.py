"""Speculation policies: how big a tree to ask the drafter for in the next step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from drafter_service.proposer import Budget
from orchestrator.stats import RequestStats


class SpeculationPolicy(Protocol):
    def next_budget(self, stats: RequestStats, remaining_tokens: int) -> Budget: ...


@dataclass(frozen=True)
class StaticPolicy:
    """The same budget every step (0 nodes = plain autoregressive decoding)."""

    max_nodes: int = 8
    max_depth: int = 8
    draft_timeout_s: float | None = None

    def next_budget(self, stats: RequestStats, remaining_tokens: int) -> Budget:
        # every step commits a bonus token after the accepted path: never draft past the end
        depth = max(0, min(self.max_depth, remaining_tokens - 1))
        deadline = time.monotonic() + self.draft_timeout_s if self.draft_timeout_s else None
        return Budget(self.max_nodes if depth else 0, depth, deadline)
