"""Proposer interface, draft budgets, per-session drafter state and the proposer registry.

A proposer turns a session's committed tokens into a candidate TokenTree within a
budget. Proposers keep any per-session state (a draft model's KV cache, ...) in
``DraftSessionState.scratch`` under their own name, so one proposer object serves
every session and the drafter shell owns session lifetimes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree


@dataclass(frozen=True)
class Budget:
    max_nodes: int  # nodes in the tree (not counting the root)
    max_depth: int  # longest root-to-leaf path
    deadline: float | None = None  # time.monotonic() by which the tree must be ready
    # SpecDec++-style stop rule: stop extending a path once its estimated probability of being
    # accepted whole (product of its nodes' draft probabilities) falls below this; 0 = off
    min_path_prob: float = 0.0
    # set by the orchestrator to end a pre-draft early (PEARL: the verification it overlaps is over)
    stop: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError("budget sizes must be >= 0")
        if not 0.0 <= self.min_path_prob <= 1.0:
            raise ValueError("min_path_prob must be in [0, 1]")

    @property
    def is_zero(self) -> bool:
        return self.max_nodes == 0 or self.max_depth == 0

    def expired(self) -> bool:
        """True once drafting should stop and return what it has: past the deadline, or told to stop."""
        if self.stop is not None and self.stop.is_set():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass
class DraftSessionState:
    session_id: str
    tokens: list[int]  # every committed token: prompt + generated
    sampling: SamplingParams
    generator: torch.Generator | None = None  # for sampled drafts
    scratch: dict[str, Any] = field(default_factory=dict)  # per-proposer state
    # tokens[:committed_len] are committed (the rest a hypothesis drafted ahead on), as last told by
    # the orchestrator; 0 = never told
    committed_len: int = 0


class Proposer(Protocol):
    """``propose`` and ``release`` are required. Optional hooks:

    - ``prepare(state)``, run when a session opens (a draft model prefills the prompt there, so the
      first step does not pay for it and the prefill can overlap the verifier's);
    - ``observe(state, feedback: DraftFeedback)``, run before ``propose`` when the orchestrator sends
      feedback: the verifications since the last call (target top-k rows, Jacobi n-grams) and how
      much of the context is committed. Learning proposers (token recycling, n-gram stores) use it.

    ``release(state)`` runs at close; the orchestrator syncs the context to exactly the committed
    tokens first, so a proposer may learn from ``state.tokens`` there."""

    name: str

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree: ...

    def release(self, state: DraftSessionState) -> None: ...


# ------------------------------------------------------------------ registry
ProposerFactory = Callable[..., Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def proposer_names() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


# what hosts (the embedded stack, the drafter server) offer every proposer factory
RESOURCES = frozenset({"draft_runner", "store", "store_spec", "store_namespace"})


def proposer_options(given: dict[str, Any], allowed: tuple[str, ...], name: str) -> dict[str, Any]:
    """A factory's own options among ``given`` (the host's resources dropped); ValueError on unknown ones."""
    options = {k: v for k, v in given.items() if k not in RESOURCES}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(unknown)}; its options: {', '.join(allowed) or 'none'}")
    return options


def make_proposer(name: str, **resources: Any) -> Proposer:
    """Build a registered proposer. ``resources``: what the host offers every proposer (``draft_runner``,
    ``store_spec`` and ``store_namespace`` for n-gram stores), plus this proposer's options. Factories
    take the resources they use and ignore the others (``**_resources``)."""
    _import_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; choose from {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**resources)


def _import_builtin() -> None:
    # Importing the modules runs their @register lines.
    from drafter_service import copy_proposer, draft_model, fusion, prompt_lookup, recycling, retrieval  # noqa: F401
