"""Per-step and per-request speculation statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)  # not frozen: one is built per request and step, and a frozen init costs 5x (2.5 µs)
class StepStats:
    num_proposed: int  # tree nodes sent to the verifier
    tree_depth: int
    num_accepted: int  # draft tokens accepted (the bonus token not included)
    accepted_sources: tuple[str, ...]  # proposer of each accepted node
    proposed_sources: tuple[str, ...]  # proposer of each proposed node
    draft_seconds: float
    verify_seconds: float
    draft_error: str = ""  # why the drafter's tree was not used, if it was not
    budget: tuple[int, int] = (0, 0)  # (max_nodes, max_depth) the policy chose for this step's tree
    step_seconds: float = 0.0  # wall time of the whole step, drafting waits included
    wait_seconds: float = 0.0  # time the verifier sat waiting for this step's tree
    drafter_busy_seconds: float = 0.0  # time the drafter spent working during this step
    predrafted: bool = False  # the tree was drafted while the previous step was being verified (PEARL)
    predraft_nodes: int = 0  # nodes drafted during this step's verification for the next step
    predraft_used: int = 0  # of those, nodes the next step's tree kept
    predraft_levels: int = 0  # depth of the tree drafted ahead (0 = none)
    predraft_seconds: float = 0.0  # drafter time it took
    ahead_confirmed: bool = False  # the verifier accepted the whole line drafted ahead on (usable if the bonus was guessed)
    batch_sessions: int = 1  # sessions the verifier verified in the same forward as this step
    draft_cpu_seconds: float = 0.0  # CPU time this process spent drafting since the previous step (~0 if remote)
    # rank of each accepted node among the tree's nodes by path probability (TokenTree.path_ranks); None = not
    # recorded, read as the top num_accepted ranks (a chain's accepted nodes are its first ones)
    accepted_ranks: tuple[int, ...] | None = None


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    num_generated: int = 0
    steps: list[StepStats] = field(default_factory=list)
    acceptance: str = "exact"  # how the verifier accepted drafts (SamplingParams.acceptance): "exact" | "mjsd"
    # what policies derive from ``steps`` and keep up to date as steps are appended (orchestrator/policy.py's
    # StepWindow), by the policy's key: per request, so no policy holds state of its own
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def lossy(self) -> bool:
        """The output may differ from the target's own decoding (MJSD's acceptance)."""
        return self.acceptance != "exact"

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step (accepted + bonus)."""
        if not self.steps:
            return 0.0
        return sum(s.num_accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens accepted per drafted token, over every step (vLLM's draft acceptance rate; a tree's
        nodes all count as drafted, so a wide tree's rate is lower at the same tau); 0 with nothing drafted."""
        proposed = sum(s.num_proposed for s in self.steps)
        return sum(s.num_accepted for s in self.steps) / proposed if proposed else 0.0

    @property
    def target_forwards_per_token(self) -> float:
        return (1 + self.num_steps) / max(self.num_generated, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.total_seconds if self.total_seconds > 0 else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Entry d: fraction of steps whose tree reached depth d+1 that accepted at least d+1 tokens."""
        return [a / r if r else 0.0 for a, r in zip(*self.position_counts(), strict=True)]

    def position_counts(self) -> tuple[list[int], list[int]]:
        """(accepted, reached) per depth position, for pooling across requests."""
        depth = max((s.tree_depth for s in self.steps), default=0)
        reached = [sum(1 for s in self.steps if s.tree_depth > d) for d in range(depth)]
        accepted = [sum(1 for s in self.steps if s.num_accepted > d) for d in range(depth)]
        return accepted, reached

    def per_source(self) -> dict[str, dict[str, int]]:
        proposed: Counter[str] = Counter()
        accepted: Counter[str] = Counter()
        for s in self.steps:
            proposed.update(s.proposed_sources)
            accepted.update(s.accepted_sources)
        return {k: {"proposed": proposed[k], "accepted": accepted[k]} for k in sorted(proposed)}

    @property
    def draft_seconds(self) -> float:
        return sum(s.draft_seconds for s in self.steps)

    @property
    def verify_seconds(self) -> float:
        return sum(s.verify_seconds for s in self.steps)

    @property
    def wall_seconds(self) -> float:
        return sum(s.step_seconds for s in self.steps)

    @property
    def verifier_idle_fraction(self) -> float:
        """Share of the steps' wall time the verifier was not verifying (waiting for drafts, overhead)."""
        wall = self.wall_seconds
        return max(0.0, 1.0 - self.verify_seconds / wall) if wall > 0 else 0.0

    @property
    def drafter_idle_fraction(self) -> float:
        wall = self.wall_seconds
        busy = sum(s.drafter_busy_seconds for s in self.steps)
        return max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0

    @property
    def predraft_used_fraction(self) -> float:
        """Of the nodes drafted ahead (during verification), the share that went into a verified tree."""
        drafted = sum(s.predraft_nodes for s in self.steps)
        return sum(s.predraft_used for s in self.steps) / drafted if drafted else 0.0

    @property
    def predrafted_steps(self) -> int:
        return sum(1 for s in self.steps if s.predrafted)

    def budgets(self) -> list[tuple[int, int]]:
        """(max_nodes, max_depth) chosen for each step, in order."""
        return [s.budget for s in self.steps]

    @property
    def num_draft_errors(self) -> int:
        return sum(1 for s in self.steps if s.draft_error)

    def summary(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.num_generated,
            "steps": self.num_steps,
            "tau": self.tau,
            "tokens_per_second": self.tokens_per_second,
            "total_seconds": self.total_seconds,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "target_forwards_per_token": self.target_forwards_per_token,
            "acceptance_per_position": self.acceptance_per_position(),
            "per_source": self.per_source(),
            "draft_errors": self.num_draft_errors,
            "verifier_idle_fraction": self.verifier_idle_fraction,
            "drafter_idle_fraction": self.drafter_idle_fraction,
            "predrafted_steps": self.predrafted_steps,
            "predraft_used_fraction": self.predraft_used_fraction,
            "budgets": self.budgets(),
            "acceptance": self.acceptance,
            "lossy": self.lossy,
        }
