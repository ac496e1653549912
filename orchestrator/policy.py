"""Speculation policies: how big a tree to ask the drafter for in the next step.

The engine asks for a budget in one of three phases:

- ``sequential``: plain draft-then-verify; the verifier waits while this tree is drafted.
- ``restart``: overlapped (PEARL) loop, but nothing drafted ahead could be used, so the
  verifier waits for this tree. A short draft here is PEARL's pre-verify: the verifier
  starts on the first token(s) while the drafter drafts on behind them.
- ``predraft``: drafted while the verifier checks the current tree; its cost is hidden.

StaticPolicy asks for the same budget every step. AdaptivePolicy picks the budget that maximises committed
tokens per second under the request's measured acceptance and costs: drafting in sequence, a node count, each
node priced by how often nodes of its rank are accepted; overlapped, the depths (pure functions below, then the
class).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import fmean, median
from typing import ClassVar, Literal, Protocol

from drafter_service.proposer import proposer_spec
from orchestrator.stats import RequestStats, StepStats
from specmesh.contract import Budget, ForwardCosts, VerifyCosts

Phase = Literal["sequential", "restart", "predraft"]

POLICIES = ("static", "adaptive")
# Measured with `specmesh bench` on the stdlib-code pair (docs/PERFORMANCE.md): overlapping drafting with
# verification, and verifying without waiting when nothing drafted ahead was usable, was fastest
# for every proposer across processes and for the draft model in process.
DEFAULT_OVERLAP = True
DEFAULT_POLICY = "static"
DEFAULT_RESTART_DEPTH = 0


class SpeculationPolicy(Protocol):
    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget: ...


def reads_ranks(policy: SpeculationPolicy) -> bool:
    """Whether ``policy`` reads ``StepStats.accepted_ranks`` (a policy says so with a true ``reads_ranks``
    attribute): the engines compute them (TokenTree.path_ranks, ~15 µs a tree) only then."""
    return bool(getattr(policy, "reads_ranks", False))


def depth_limit(max_depth: int, remaining_tokens: int) -> int:
    """Every step commits a bonus token after the accepted path: never draft past the end."""
    return max(0, min(max_depth, remaining_tokens - 1))


def deadline_in(seconds: float | None) -> float | None:
    return time.monotonic() + seconds if seconds else None


@dataclass(frozen=True)
class StaticPolicy:
    """The same budget every step (0 nodes = plain autoregressive decoding)."""

    max_nodes: int
    max_depth: int
    draft_timeout_s: float | None = None
    restart_depth: int | None = None  # depth of a ``restart`` draft (pre-verify); None = max_depth

    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget:
        nodes, depth = self.max_nodes, self.max_depth
        if phase == "restart" and self.restart_depth is not None and self.restart_depth < depth:
            # a shallower tree keeps the same share of nodes per level
            nodes, depth = max(self.restart_depth, nodes * self.restart_depth // depth), self.restart_depth
        depth = depth_limit(depth, remaining_tokens)
        return Budget(nodes if depth else 0, depth, deadline_in(self.draft_timeout_s))


# ------------------------------------------------------------------ adaptive policy: estimates
# Units: seconds, fitted from the request's own steps. Before any history the priors are in units of
# one verification (a = 1.0): only the ratios between costs matter to the choice.
NODE_COST_FRACTION = 1 / 64  # b = a/64 when the window shows no spread in tree size: a verifier at small
#                              trees is bound by reading its weights, so one more node costs little
PROBE_DEPTH = 2  # depth of the probe drafted after ``probe_every`` steps without a tree
_TIE = 1e-12  # relative: a deeper tree must beat a shallower one by more than rounding


def conditional_acceptance(
    steps: Sequence[StepStats], max_depth: int, prior: float = 0.6, prior_weight: float = 2.0
) -> list[float]:
    """[max_depth] alpha[j] = P(draft position j+1 accepted | positions 1..j accepted, tree reached depth j+1).

    A step with tree depth D and a accepted draft tokens tried position j+1 (j < D) if a >= j, and had it
    accepted if a > j; empty trees say nothing. Each position is shrunk towards the estimate of the one
    before it (the first towards ``prior``) with ``prior_weight`` pseudo-steps, so alpha is defined with no
    data and a depth not tried yet inherits the rate measured above it rather than the global prior.
    """
    tried, accepted = [0] * max_depth, [0] * max_depth
    for s in steps:
        for j in range(min(s.tree_depth, s.num_accepted + 1, max_depth)):
            tried[j] += 1
            accepted[j] += j < s.num_accepted
    return shrunk_rates(tried, accepted, prior, prior_weight)


def shrunk_rates(tried: Sequence[int], accepted: Sequence[int], prior: float, prior_weight: float,
                 base: Sequence[float] | None = None) -> list[float]:
    """Per position, accepted / tried shrunk towards the position before it (the first towards ``prior``) with
    ``prior_weight`` pseudo-trials: ``conditional_acceptance``'s estimate from its counts. ``base``: rates per
    position to shrink towards instead (the pooled estimate of the method's other requests, ``MethodSteps``)."""
    alpha, mean = [], prior
    for j, (t, a) in enumerate(zip(tried, accepted, strict=True)):
        if base is not None:
            mean = base[j]
        if t + prior_weight > 0:
            mean = (a + prior_weight * mean) / (t + prior_weight)
        alpha.append(mean)
    return alpha


class StepWindow:
    """The counts the load-aware cap reads of a request's last ``size`` steps, kept up to date as steps are
    appended (``sync``: the new steps in, the ones that left the window out), so that a step's budget costs
    O(depth) rather than a pass over the window for every request of every step. The counts are integers: the
    estimates equal a pass's (``conditional_acceptance``, ``fill_ratio``) exactly.

    A step tried draft positions 1..m, m = min(tree depth, accepted + 1), and had 1..min(m, accepted) accepted:
    ``tried_end[m]`` / ``accepted_end[k]`` count the steps whose runs end there, so the tried count of position
    j + 1 is the number of runs that end past j (for any depth cap: a cap only cuts runs at positions past it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._steps: list[StepStats] | None = None  # the list synced with (a new list: counted afresh)
        self._seen = 0  # its steps taken in
        self.tried_end: list[int] = [0]
        self.accepted_end: list[int] = [0]
        self.asked = self.got = self.levels = 0  # budgeted nodes (of steps with a budget), nodes sent, levels
        self.draft_cpu = 0.0  # the steps' draft_cpu_seconds
        self.version = 0  # changes whenever the counts do (a step that tried, asked, budgeted or drafted)

    def sync(self, steps: list[StepStats]) -> None:
        """Take in the steps appended since the last call and let out those that left the window."""
        n, seen, size = len(steps), self._seen, self.size
        if steps is not self._steps or n < seen:
            version = self.version
            self.__init__(size)
            self._steps, seen, self.version = steps, 0, version + 1
        for s in steps[max(0, seen - size) : min(seen, max(0, n - size))]:
            self.count(s, -1)
        for s in steps[max(seen, n - size) :]:
            self.count(s, 1)
        self._seen = n

    def count(self, s: StepStats, sign: int) -> None:
        """Add (sign 1) or remove (-1) one step's counts."""
        accepted = s.num_accepted
        m = min(s.tree_depth, accepted + 1)
        if m > 0:
            if m >= len(self.tried_end):
                grow = m + 1 - len(self.tried_end)
                self.tried_end += [0] * grow
                self.accepted_end += [0] * grow
            self.tried_end[m] += sign
            self.accepted_end[min(m, accepted)] += sign
        nodes, depth = s.budget
        if nodes > 0:
            self.asked += sign * nodes
            self.got += sign * s.num_proposed
        if m > 0 or nodes > 0 or depth > 0 or s.draft_cpu_seconds:
            self.levels += sign * depth
            self.draft_cpu += sign * s.draft_cpu_seconds
            self.version += 1

    def acceptance(self, max_depth: int, prior: float, prior_weight: float,
                   base: Sequence[float] | None = None) -> list[float]:
        """``conditional_acceptance`` of the window's steps (``base``: as ``shrunk_rates``)."""
        tried, accepted = [0] * max_depth, [0] * max_depth
        t = sum(self.tried_end[max_depth + 1 :])  # runs that end past the cap count at every position under it
        a = sum(self.accepted_end[max_depth + 1 :])
        for j in range(max_depth - 1, -1, -1):
            if j + 1 < len(self.tried_end):
                t += self.tried_end[j + 1]
                a += self.accepted_end[j + 1]
            tried[j], accepted[j] = t, a
        return shrunk_rates(tried, accepted, prior, prior_weight, base)

    @property
    def tried(self) -> int:
        """Steps of the window that tried a first draft position."""
        return sum(self.tried_end[1:])

    def draft_per_level(self) -> float:
        """``draft_cpu_per_level`` of the window's steps (0 without a budgeted level)."""
        return max(0.0, self.draft_cpu) / self.levels if self.levels > 0 else 0.0

    def fill(self, prior_nodes: float = 4.0) -> float:
        """``fill_ratio`` of the window's steps."""
        return (self.got + prior_nodes) / (self.asked + prior_nodes)


def expected_tokens(alpha: Sequence[float], depth: int) -> float:
    """Tokens committed per step with a tree ``depth`` levels deep: 1 (bonus) + sum_i prod_{j<=i} alpha[j-1]."""
    assert 0 <= depth <= len(alpha), (depth, len(alpha))
    total, path = 1.0, 1.0
    for a in alpha[:depth]:
        path *= a
        total += path
    return total


@dataclass(frozen=True)
class CostModel:
    """Seconds of one step's parts."""

    verify_fixed: float  # a: a verification of an empty tree
    verify_per_node: float  # b: each tree node on top
    draft_per_level: float  # one drafted depth level (a drafter call's fixed cost is spread over its levels)
    overhead: float  # the rest of a step: network round trips, orchestration

    def verify(self, num_nodes: int) -> float:
        return self.verify_fixed + self.verify_per_node * num_nodes


def fit_costs(steps: Sequence[StepStats], draft_cost_ratio: float = 0.1) -> CostModel:
    """Least-squares verify = a + b*num_proposed (robust variant when plain steps exist); median draft
    seconds per level of the trees drafted, whether the verifier waited for them or they were drafted
    ahead (a pre-draft cut before its first level, having run as long as the verification: its seconds);
    median step overhead (step - verify - wait, clamped >= 0).
    Missing data falls back to priors: a = 1 unit, b = a * NODE_COST_FRACTION, a draft level =
    ``draft_cost_ratio`` * a, no overhead."""
    points = [(s.num_proposed, s.verify_seconds) for s in steps if s.verify_seconds > 0]
    a, b = 1.0, NODE_COST_FRACTION
    plain = [v for n, v in points if n == 0]
    drafted = [(n, v) for n, v in points if n > 0]
    if len(plain) >= 2 and drafted:
        # robust when plain steps exist (a policy that mostly decodes plainly, the restarts of the
        # overlapped loop): a = their median, b = the median extra per node of the others
        a = median(plain)
        b = max(0.0, median((v - a) / n for n, v in drafted))
    elif points:
        n_mean, v_mean = fmean(n for n, _ in points), fmean(v for _, v in points)
        var = sum((n - n_mean) ** 2 for n, _ in points)
        b = max(0.0, sum((n - n_mean) * (v - v_mean) for n, v in points) / var) if var > 0 else -1.0
        a = v_mean - b * n_mean
        if b < 0 or a <= 0:  # no spread in tree size, or a line through or below the origin (noise)
            a = v_mean / (1 + NODE_COST_FRACTION * n_mean)
            b = NODE_COST_FRACTION * a
    levels = [s.draft_seconds / s.tree_depth for s in steps if s.tree_depth > 0 and not s.predrafted]
    # drafts made ahead count too: with restarts at depth 0 they are the only drafting there is
    levels += [s.predraft_seconds / s.predraft_levels for s in steps if s.predraft_levels > 0]
    # and so do those the verification's end cut before their first level, having run at least as long as it:
    # a level costs at least what they ran (without them a drafter slower than the verifier, whose every
    # pre-draft is cut so, would never be measured, and the prior would keep it drafting ahead for nothing)
    levels += [s.predraft_seconds for s in steps
               if s.predraft_levels == 0 and s.predraft_seconds >= s.verify_seconds > 0]
    overheads = [max(0.0, s.step_seconds - s.verify_seconds - s.wait_seconds) for s in steps if s.step_seconds > 0]
    return CostModel(a, b, median(levels) if levels else draft_cost_ratio * a, median(overheads) if overheads else 0.0)


# ------------------------------------------------------------------ adaptive policy: choices
def nodes_for_depth(depth: int, max_nodes: int, max_depth: int) -> int:
    """Nodes of a tree ``depth`` deep under caps (max_nodes, max_depth): chains stay chains, trees keep width."""
    if depth <= 0:
        return 0
    return min(max_nodes, max(depth, round(max_nodes * depth / max_depth)))


def step_time(depth: int, verify_seconds: float, draft_level_cost: float, overhead: float, hidden: bool) -> float:
    """Seconds of a step with a tree ``depth`` deep. ``hidden``: drafted during the previous verification
    (phase "predraft"), so only drafting beyond the verification's length costs."""
    draft = draft_level_cost * depth
    return overhead + (max(verify_seconds, draft) if hidden else verify_seconds + draft)


def choose_depth(
    alpha: Sequence[float],
    verify_cost: Callable[[int], float],  # num_nodes -> seconds
    draft_level_cost: float,
    overhead: float,
    nodes_for_depth: Callable[[int], float],  # depth -> nodes the verifier checks
    phase: Phase,
    max_depth: int,
) -> int:
    """argmax over d in 0..max_depth of expected_tokens(d) / step_time(d): committed tokens per second.
    0 (plain decoding) when speculation does not pay; the shallower tree on ties."""
    hidden = phase == "predraft"
    rates, tokens, path = [], 1.0, 1.0
    for d in range(max_depth + 1):
        if d:
            path *= alpha[d - 1]
            tokens += path
        rates.append(tokens / step_time(d, verify_cost(nodes_for_depth(d)), draft_level_cost, overhead, hidden))
    best = max(rates)
    return next(d for d, r in enumerate(rates) if r >= best * (1 - _TIE))


def rank_acceptance(
    steps: Sequence[StepStats], max_nodes: int, prior: float = 0.6, prior_weight: float = 2.0
) -> tuple[list[float], list[float]]:
    """([max_nodes] p, [max_nodes] sent), indexed by a node's rank in its tree (``TokenTree.path_ranks``: the order
    in which a best-first drafter spends its budget).

    p[k] = P(the rank-k node is on the accepted path | the tree has more than k nodes);
    sent[k] = P(the drafter sends more than k nodes | the budget allows more than k) (copy proposers send
    fewer, or none, when nothing matches). A budget of n nodes then commits 1 + sum_{k<n} sent[k] p[k] tokens a
    step in expectation (a node's chance to be on the accepted path, summed over the nodes) and has the verifier
    check sum_{k<n} sent[k] nodes: EAGLE-2's view that a node is worth its path's acceptance, whatever the
    tree's shape. Each estimate is shrunk towards the one of the rank before it (p[0] towards ``prior``,
    sent[0] towards 1) with ``prior_weight`` pseudo-steps, so a rank not tried yet inherits the one above it
    (the policy bounds how far it trusts that: ``AdaptivePolicy``'s growth cap). A step without
    ``accepted_ranks`` counts its accepted nodes as the top ranks (right for chains)."""
    trees, budgets, sents = [0] * (max_nodes + 1), [0] * (max_nodes + 1), [0] * (max_nodes + 1)  # by size
    hits = [0] * max_nodes
    for s in steps:
        n, budget = min(s.num_proposed, max_nodes), min(s.budget[0], max_nodes)
        trees[n] += 1
        budgets[budget] += 1
        sents[min(n, budget)] += 1
        for r in range(s.num_accepted) if s.accepted_ranks is None else s.accepted_ranks:
            if r < max_nodes:
                hits[r] += 1
    tried, asked, got = [0] * (max_nodes + 1), [0] * (max_nodes + 1), [0] * (max_nodes + 1)
    for k in range(max_nodes - 1, -1, -1):  # suffix sums: steps with more than k nodes, budgets of more than k
        tried[k], asked[k], got[k] = tried[k + 1] + trees[k + 1], asked[k + 1] + budgets[k + 1], got[k + 1] + sents[k + 1]
    p, sent, mean_p, mean_s = [], [], prior, 1.0
    for k in range(max_nodes):
        mean_p = (hits[k] + prior_weight * mean_p) / (tried[k] + prior_weight)
        mean_s = (got[k] + prior_weight * mean_s) / (asked[k] + prior_weight)
        p.append(mean_p)
        sent.append(mean_s)
    return p, sent


def depth_per_node(steps: Sequence[StepStats], prior: float = 1.0) -> float:
    """Levels per node of the drafter's trees (1 for chains; a wide tree less), so that an n-node budget's
    drafting is priced at about n * this levels; ``prior`` before any tree."""
    nodes = sum(s.num_proposed for s in steps)
    return sum(s.tree_depth for s in steps) / nodes if nodes else prior


def choose_nodes(
    p: Sequence[float],
    sent: Sequence[float],
    verify_cost: Callable[[float], float],  # nodes checked -> seconds
    draft_cost: Callable[[int], float],  # budgeted nodes -> seconds of drafting
    overhead: float,
    max_nodes: int,
) -> int:
    """argmax over n in 0..max_nodes of (1 + sum_{k<n} sent[k] p[k]) / (overhead + verify_cost(sum_{k<n} sent[k])
    + draft_cost(n)): committed tokens per second of a sequential step with an n-node budget (``rank_acceptance``).
    0 (plain decoding) when speculation does not pay; the smaller budget on ties."""
    best, choice, tokens, rows = -1.0, 0, 1.0, 0.0
    for n in range(max_nodes + 1):
        if n:
            tokens += sent[n - 1] * p[n - 1]
            rows += sent[n - 1]
        rate = tokens / (overhead + verify_cost(rows) + draft_cost(n))
        if rate > best * (1 + _TIE):
            best, choice = rate, n
    return choice


def fill_ratio(steps: Sequence[StepStats], prior_nodes: float = 4.0) -> float:
    """Share of the budgeted nodes the drafter really proposed (prompt lookup proposes fewer, or none when
    nothing matches), shrunk towards 1 with ``prior_nodes`` pseudo-nodes; the verifier pays for these."""
    asked = sum(s.budget[0] for s in steps if s.budget[0] > 0)
    got = sum(s.num_proposed for s in steps if s.budget[0] > 0)
    return (got + prior_nodes) / (asked + prior_nodes)


def bonus_guess_rate(steps: Sequence[StepStats], prior: float = 0.6, prior_weight: float = 2.0) -> float:
    """g: of the steps whose drafted-ahead line the verifier confirmed, the share whose pre-draft also
    guessed the bonus token (so the next step started without waiting), shrunk towards ``prior``."""
    confirmed = [s for s in steps if s.ahead_confirmed]
    hits = sum(1 for s in confirmed if s.predraft_used > 0)
    return (hits + prior_weight * prior) / (len(confirmed) + prior_weight)


def overlap_rate(
    restart: tuple[float, float, float], ahead: tuple[float, float, float], guess: float
) -> float:
    """Committed tokens per second of the overlapped loop in its steady state.

    Two kinds of step, each given as (expected tokens E, chance P that the verifier confirms the
    tree's whole line, seconds): a restart (nothing drafted ahead was usable; the verifier waits
    for its tree, or verifies none) and an ahead step (its tree was drafted during the previous
    verification). After any step the next one is an ahead step when its line was confirmed and the
    pre-draft guessed the bonus token (prob. ``guess``). Ahead steps per restart are then
    r = guess * P_restart / (1 - guess * P_ahead) (a geometric run), and the rate is
    (E_restart + r E_ahead) / (seconds_restart + r seconds_ahead)."""
    (e_r, p_r, t_r), (e_a, p_a, t_a) = restart, ahead
    r = guess * p_r / max(1e-9, 1 - guess * p_a)
    return (e_r + r * e_a) / (t_r + r * t_a)


def choose_overlap(
    alpha: Sequence[float], guess: float, costs: CostModel, nodes_for_depth: Callable[[int], float], max_depth: int
) -> tuple[int, int]:
    """(restart depth, ahead depth) with the best ``overlap_rate``. A restart pays for its drafting; an
    ahead step's drafting (one level more: the bonus guesses) is hidden unless it outlasts the verification.
    The per-depth figures are computed once, so the (max_depth + 1)^2 grid is plain arithmetic."""
    tokens, confirmed = [1.0], [1.0]  # E(d) and prod(alpha[:d]) for d = 0..max_depth
    for a in alpha[:max_depth]:
        confirmed.append(confirmed[-1] * a)
        tokens.append(tokens[-1] + confirmed[-1])
    restarts, aheads = [], []
    for d in range(max_depth + 1):
        verify = costs.verify(nodes_for_depth(d))
        restarts.append((tokens[d], confirmed[d], costs.overhead + costs.draft_per_level * d + verify))
        aheads.append((tokens[d], confirmed[d], costs.overhead + max(verify, costs.draft_per_level * (d + 1))))
    best, choice = -1.0, (0, 0)
    for dr, restart in enumerate(restarts):
        for da, ahead in enumerate(aheads):
            rate = overlap_rate(restart, ahead, guess)
            if rate > best * (1 + _TIE):
                best, choice = rate, (dr, da)
    return choice


def node_cost(costs: CostModel, depth: int, num_nodes: int, hidden: bool) -> float:
    """Seconds one more node adds to a step of ``depth`` levels and ``num_nodes`` nodes: its share of a draft
    level (a level has num_nodes/depth nodes) plus its verification. With drafting hidden (predraft) only
    the longer of the two grows."""
    draft = costs.draft_per_level * depth / num_nodes
    if not hidden:
        return draft + costs.verify_per_node
    return draft if costs.draft_per_level * depth > costs.verify(num_nodes) else costs.verify_per_node


def stop_threshold(node_seconds: float, seconds_per_token: float, max_stop: float = 0.5) -> float:
    """SpecDec++ stop rule for Budget.min_path_prob. A node whose path is accepted whole with probability P
    saves P * seconds_per_token (the step's seconds per committed token) and costs ``node_seconds``; drafting
    it pays while P > node_seconds / seconds_per_token. Clamped to [0, max_stop]."""
    if seconds_per_token <= 0:
        return 0.0
    return min(max_stop, max(0.0, node_seconds / seconds_per_token))


@dataclass(frozen=True)
class AdaptivePolicy:
    """Chooses each step's budget from the request's own recent steps (the functions above).

    Stateless apart from its configuration: each call recomputes from the last ``window`` steps, in
    O(window * max_depth), and history older than that (a stretch where drafting did not pay) drops out.
    After ``probe_every`` steps in a row with no tree chosen, it drafts a depth-PROBE_DEPTH probe so acceptance
    keeps being measured, unless speculation could not pay even if every draft token were accepted.
    """

    max_nodes: int  # caps, e.g. the proposer's default budget
    max_depth: int
    draft_timeout_s: float | None = None
    window: int = 32  # recent steps the estimates use
    prior_acceptance: float = 0.6
    prior_weight: float = 4.0  # pseudo-steps behind the prior
    draft_cost_ratio: float = 0.1  # before any drafted tree: a draft level costs this share of a verification
    probe_every: int = 4  # 0 = never probe
    max_stop: float = 0.1  # cap on Budget.min_path_prob (draft probabilities are not calibrated acceptance rates)
    reads_ranks: ClassVar[bool] = True  # the sequential steps' node choice (rank_acceptance)

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.max_depth) < 0 or self.window < 1 or self.prior_weight <= 0:
            raise ValueError("caps must be >= 0, window >= 1, prior_weight > 0")
        if not 0 <= self.probe_every <= self.window:
            raise ValueError("probe_every must be in [0, window]")
        if not (0 <= self.prior_acceptance <= 1 and 0 <= self.max_stop <= 1):
            raise ValueError("prior_acceptance and max_stop must be in [0, 1]")

    def nodes(self, depth: int) -> int:
        return nodes_for_depth(depth, self.max_nodes, self.max_depth)

    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget:
        deadline = deadline_in(self.draft_timeout_s)
        limit = depth_limit(min(self.max_depth, self.max_nodes), remaining_tokens)
        if limit == 0:
            return Budget(0, 0, deadline)
        steps = stats.steps[-self.window:]
        costs = fit_costs(steps, self.draft_cost_ratio)
        if phase == "sequential":
            return self._sequential_budget(steps, costs, limit, deadline)
        # the overlapped loop: restarts and ahead steps are chosen together, for the steady state
        alpha = conditional_acceptance(steps, limit, self.prior_acceptance, self.prior_weight)
        fill = fill_ratio(steps)

        def verified_nodes(depth: int) -> float:  # what a budget of this depth costs the verifier
            return self.nodes(depth) * fill

        model = (costs.verify, costs.draft_per_level, costs.overhead, verified_nodes, phase, limit)
        guess = bonus_guess_rate(steps, self.prior_acceptance, self.prior_weight)
        restart, ahead = choose_overlap(alpha, guess, costs, verified_nodes, limit)
        depth = restart if phase == "restart" else ahead
        if depth == 0:
            if self._probe_due(steps) and choose_depth([1.0] * limit, *model) > 0:
                depth = min(PROBE_DEPTH, limit)
                return Budget(self.nodes(depth), depth, deadline)
            return Budget(0, 0, deadline)
        nodes, hidden = self.nodes(depth), phase == "predraft"
        seconds = step_time(depth, costs.verify(nodes), costs.draft_per_level, costs.overhead, hidden)
        per_token = seconds / expected_tokens(alpha, depth)
        threshold = stop_threshold(node_cost(costs, depth, nodes, hidden), per_token, self.max_stop)
        return Budget(nodes, depth, deadline, threshold)

    def _sequential_budget(self, steps: Sequence[StepStats], costs: CostModel, limit: int,
                           deadline: float | None) -> Budget:
        """Draft-then-verify: the node count with the best committed tokens per second (``choose_nodes``), the
        tree's shape left to the drafter (depth up to the node count)."""
        p, sent = rank_acceptance(steps, self.max_nodes, self.prior_acceptance, self.prior_weight)
        levels = depth_per_node(steps)

        def depth(n: int) -> int:  # levels an n-node budget's tree is expected to take
            return min(limit, max(1, round(levels * n))) if n else 0

        def draft(n: int) -> float:
            return costs.draft_per_level * depth(n)

        # ranks past the largest budget of the window were never tried: at most double it (a slow start)
        grow = min(self.max_nodes, max(2 * PROBE_DEPTH, 2 * max((s.budget[0] for s in steps), default=0)))
        nodes = choose_nodes(p, sent, costs.verify, draft, costs.overhead, grow)
        if nodes == 0:
            ones = [1.0] * self.max_nodes
            if self._probe_due(steps) and choose_nodes(ones, ones, costs.verify, draft, costs.overhead,
                                                       self.max_nodes) > 0:
                return Budget(self.nodes(min(PROBE_DEPTH, limit)), min(PROBE_DEPTH, limit), deadline)
            return Budget(0, 0, deadline)
        tokens = 1.0 + sum(s * a for s, a in zip(sent[:nodes], p[:nodes], strict=True))
        seconds = costs.overhead + costs.verify(sum(sent[:nodes])) + draft(nodes)
        threshold = stop_threshold(node_cost(costs, depth(nodes), nodes, False), seconds / tokens, self.max_stop)
        return Budget(nodes, min(limit, nodes), deadline, threshold)

    def _probe_due(self, steps: Sequence[StepStats]) -> bool:
        recent = steps[-self.probe_every:] if self.probe_every else ()
        return len(recent) == self.probe_every > 0 and all(s.budget[1] == 0 and s.tree_depth == 0 for s in recent)


# ------------------------------------------------------------------ load-aware cap (SmartSpec goodput)
def nodes_at(depth: int, max_nodes: int, max_depth: int) -> int:
    """Nodes of a budget cut from (max_nodes, max_depth) to ``depth`` levels: the same share per level."""
    return 0 if depth == 0 else max(depth, max_nodes * depth // max(max_depth, 1))


def batch_goodput(alpha: Sequence[float], costs: ForwardCosts, sessions: int, max_nodes: int, max_depth: int,
                  fill: float = 1.0, draft_per_level: float = 0.0) -> tuple[int, float]:
    """The depth (0..max_depth) maximising the batch's committed tokens per second when all ``sessions``
    verify trees of that size in one forward: sessions * E[tokens(d)] / costs.seconds(sessions,
    sessions * (1 + fill * nodes(d))), ``fill`` = the share of a budget's nodes the drafter really sends.
    Every session's extra rows slow the whole step, so at a large batch trees shrink unless they are
    accepted well enough to pay for that. ``draft_per_level``: CPU seconds of one drafted level when every
    session's drafting runs on the verifier's cores (one process): sessions * depth of them join the step.
    Also the goodput of the best tree (depth >= 1) over that of none (0 if max_depth is 0; inf if the costs
    give no step a positive time): how far a choice of no tree is from a tie."""
    # (runs per request and step under load: expected_tokens and nodes_at written out, a level at a time)
    rate = plain = 1.0 / costs.seconds(sessions, sessions)  # depth 0: the bonus token alone
    best, best_rate, tree_rate = 0, (rate if rate > 0.0 else 0.0), 0.0
    tokens, path, per_level = 1.0, 1.0, max(max_depth, 1)
    for depth in range(1, max_depth + 1):
        path *= alpha[depth - 1]
        tokens += path  # expected_tokens(alpha, depth)
        rows = sessions * (1 + fill * max(depth, max_nodes * depth // per_level))  # nodes_at(depth, ...)
        rate = tokens / (costs.seconds(sessions, rows) + sessions * depth * draft_per_level)
        tree_rate = max(tree_rate, rate)
        if rate > best_rate * (1 + 1e-9):  # a deeper tree must gain more than rounding
            best, best_rate = depth, rate
    return best, (tree_rate / plain if plain > 0.0 else math.inf)


def batch_goodput_depth(alpha: Sequence[float], costs: ForwardCosts, sessions: int, max_nodes: int,
                        max_depth: int, fill: float = 1.0, draft_per_level: float = 0.0) -> int:
    """``batch_goodput``'s depth."""
    return batch_goodput(alpha, costs, sessions, max_nodes, max_depth, fill, draft_per_level)[0]


NO_BUDGET = Budget(0, 0)  # a held cap's budget: no tree (one instance, built once)


class MethodSteps:
    """One method's requests on one verifier, pooled for the load-aware cap (``LoadAwarePolicy``): the counts of
    the last ``size`` steps that asked for a tree, whichever request took them, and how many requests the verifier
    runs now. A request's own few steps say little of its acceptance, the method's other requests more: the cap
    shrinks a request's estimate towards the pooled one (instead of a fixed prior), and sizes a request's first
    tree, before it has a batch of its own, for the requests running now at the pooled acceptance (once the pool
    has tried enough steps; until then the first tree is the inner budget: someone has to measure). Owned by an
    engine core (``EngineCore.method_steps``); fed and read on its loop thread only."""

    def __init__(self, running: Callable[[], int] = lambda: 1, size: int = 64) -> None:
        self.running = running  # requests the verifier runs now: the batch a request's first step joins
        self.window = StepWindow(size)
        self._steps: deque[StepStats] = deque()
        self._rates: tuple = ()  # (version, max_depth, prior, prior_weight, rates) of the last ``acceptance``

    def add(self, steps: Sequence[StepStats]) -> None:
        """Take in a request's new steps; those that asked for no tree say nothing of acceptance and stay out."""
        window, pooled = self.window, self._steps
        for s in steps:
            if s.budget[0] > 0:
                if len(pooled) == window.size:
                    window.count(pooled.popleft(), -1)
                pooled.append(s)
                window.count(s, 1)

    def acceptance(self, max_depth: int, prior: float, prior_weight: float) -> list[float]:
        """``conditional_acceptance`` of the pooled steps (computed once per step taken in)."""
        key = (self.window.version, max_depth, prior, prior_weight)
        if self._rates[:4] != key:
            self._rates = (*key, self.window.acceptance(max_depth, prior, prior_weight))
        return self._rates[4]


@dataclass(frozen=True)
class LoadAwarePolicy:
    """Another policy's budget, capped at the depth that maximises the verifier's goodput at its current
    batch (``batch_goodput``), with the request's own acceptance (``conditional_acceptance``) and the
    verifier's measured costs (``ForwardCosts``: in process refitted to its steps). The batch is the one the request's last step was verified
    in. A request alone on its verifier keeps the inner budget, so a seeded request that runs alone
    reproduces exactly whatever the deployment (under load its trees, hence its random stream, depend on
    the others; its distribution never does).

    A budget the cap takes firmly to nothing (the best tree's goodput under ``hold_below`` of no tree's) stays
    nothing for the request's next ``hold_steps`` steps without being computed again (per phase), unless its
    batch shrinks to 3/4 or less of the one it was computed at (a batch whose requests come and go moves by one
    or two all the time). Under a load that zeroes every tree, a speculating request then costs a step about
    what plain decoding does (the computation is ~20 µs a request and step); a choice of nothing near a tie (the
    CPU's usual one: trees come and go as acceptance and costs move) is computed again at the next step, if
    anything it reads changed: the request's window, the pool, the costs' current fit (a ``LiveCosts``' ``current``
    or a ``VerifyCosts``; costs of any other kind may change in place and are read every time), the batch, or the
    inner budget's size. Otherwise the last choice stands.

    ``pooled``: the steps of the method's requests on this verifier together (``MethodSteps``): the request's
    acceptance is shrunk towards theirs, and its first tree is capped for the requests running now once the
    pool has tried ``min_pooled`` steps (without it, a request's first tree is the inner budget)."""

    inner: SpeculationPolicy
    costs: ForwardCosts
    drafting_shares_cores: bool = False  # drafters run on the verifier's cores (embedded): their time counts
    window: int = 32
    prior_acceptance: float = 0.6
    prior_weight: float = 4.0
    hold_steps: int = 8
    hold_below: float = 0.8
    pooled: MethodSteps | None = field(default=None, compare=False)
    min_pooled: int = 8

    @property
    def reads_ranks(self) -> bool:
        return reads_ranks(self.inner)

    def next_budget(self, stats: RequestStats, remaining_tokens: int, phase: Phase = "sequential") -> Budget:
        steps, pooled = stats.steps, self.pooled
        sessions = steps[-1].batch_sessions if steps else 1
        key = ("load_aware_held", self.hold_steps, phase)  # (held while fewer steps than this, its batch)
        held = stats.derived.get(key)
        if held is not None and sessions > 1 and len(steps) < held[0] and 4 * sessions > 3 * held[1]:
            return NO_BUDGET
        if pooled is not None:
            fed = stats.derived.get("load_aware_pooled", 0)  # the request's steps the pool has taken in
            if fed < len(steps):
                pooled.add(steps[fed:])
                stats.derived["load_aware_pooled"] = len(steps)
            if not steps and pooled.window.tried >= self.min_pooled:
                sessions = pooled.running()  # a first tree: the batch it joins, at the method's acceptance
        budget = self.inner.next_budget(stats, remaining_tokens, phase)
        if budget.max_depth == 0 or sessions <= 1:
            return budget
        window = stats.derived.get(("load_aware", self.window))
        if window is None:
            window = stats.derived[("load_aware", self.window)] = StepWindow(self.window)
        window.sync(steps)  # the last ``window`` steps' counts, updated with the steps since the last call
        # the choice is a function of these: made again only when one of them changed (None: costs that may
        # change in place, never reused)
        snapshot = getattr(self.costs, "current", self.costs if isinstance(self.costs, VerifyCosts) else None)
        inputs = (window.version, -1 if pooled is None else pooled.window.version, snapshot, sessions,
                  budget.max_nodes, budget.max_depth)
        memo = stats.derived.get(("load_aware_choice", phase))
        if snapshot is not None and memo is not None and memo[0] == inputs:
            depth, tree_gain = memo[1]
        else:
            depth, tree_gain = self._choose(window, pooled, sessions, budget)
            stats.derived[("load_aware_choice", phase)] = (inputs, (depth, tree_gain))
        if depth == 0 and tree_gain < self.hold_below and self.hold_steps > 0:  # the next hold_steps calls: nothing
            stats.derived[key] = (len(steps) + 1 + self.hold_steps, sessions)
        if depth >= budget.max_depth:
            return budget
        return Budget(nodes_at(depth, budget.max_nodes, budget.max_depth), depth, budget.deadline,
                      budget.min_path_prob)

    def _choose(self, window: StepWindow, pooled: MethodSteps | None, sessions: int,
                budget: Budget) -> tuple[int, float]:
        """``batch_goodput`` for the request's window (what it lacks taken from ``pooled``) at ``sessions``."""
        base = None if pooled is None else pooled.acceptance(budget.max_depth, self.prior_acceptance,
                                                             self.prior_weight)
        alpha = window.acceptance(budget.max_depth, self.prior_acceptance, self.prior_weight, base)
        draft = 0.0  # what the request's own steps lack, the method's pooled steps tell
        if self.drafting_shares_cores:  # draft_cpu_per_level
            draft = (window if window.levels or pooled is None else pooled.window).draft_per_level()
        fill = window.fill() if window.asked or pooled is None else pooled.window.fill()
        return batch_goodput(alpha, self.costs, sessions, budget.max_nodes, budget.max_depth, fill, draft)


def draft_cpu_per_level(steps: Sequence[StepStats]) -> float:
    """CPU seconds of drafting per budgeted level (thread CPU time, so waiting for cores a loaded process
    shares does not count, unlike the drafter's wall time)."""
    levels = sum(s.budget[1] for s in steps)
    return sum(s.draft_cpu_seconds for s in steps) / levels if levels else 0.0


def load_aware(policy: SpeculationPolicy, costs: ForwardCosts | None, drafting_shares_cores: bool = False,
               pooled: MethodSteps | None = None) -> SpeculationPolicy:
    """``policy`` capped by the verifier's load when the verifier measured its costs (else as it is);
    ``drafting_shares_cores``: drafters and verifier in one process (their drafting time counts too); ``pooled``:
    the steps of the method's requests on that verifier (``EngineCore.method_steps``)."""
    return policy if costs is None else LoadAwarePolicy(policy, costs, drafting_shares_cores, pooled=pooled)


# ------------------------------------------------------------------ a request's budget and policy
def resolve_budget(proposer: str | None, max_nodes: int | None = None, max_depth: int | None = None,
                   limit: int | None = None) -> tuple[int, int]:
    """A request's (max_nodes, max_depth): what it asks for, the proposer's registered default for what it
    leaves unset, max_nodes clamped to ``limit`` (the largest tree the verifier takes); (0, 0) for plain
    decoding (``proposer`` None). The one place where a budget is defaulted and clamped: the orchestrator's
    edge (the embedded stack, `serve`). ValueError for an unknown proposer or negative sizes."""
    if proposer is None:
        return 0, 0
    nodes, depth = proposer_spec(proposer).default_budget
    nodes = nodes if max_nodes is None else max_nodes
    depth = depth if max_depth is None else max_depth
    if nodes < 0 or depth < 0:
        raise ValueError(f"budget sizes must be >= 0, got max_nodes={nodes}, max_depth={depth}")
    return (nodes if limit is None else min(nodes, limit)), depth


def build_policy(
    name: str, max_nodes: int, max_depth: int, draft_timeout_s: float | None = None, restart_depth: int | None = None
) -> SpeculationPolicy:
    """``static``: the budget every step (``restart_depth``: depth of trees the verifier waits for in the
    overlapped loop; None = DEFAULT_RESTART_DEPTH); ``adaptive``: chosen per step from acceptance and
    costs, with the budget as its cap."""
    if restart_depth is not None and restart_depth < 0:
        raise ValueError(f"restart_depth must be >= 0, got {restart_depth}")
    if name == "static":
        restart = DEFAULT_RESTART_DEPTH if restart_depth is None else restart_depth
        return StaticPolicy(max_nodes, max_depth, draft_timeout_s, restart)
    if name == "adaptive":
        return AdaptivePolicy(max_nodes=max_nodes, max_depth=max_depth, draft_timeout_s=draft_timeout_s)
    raise ValueError(f"unknown speculation policy {name!r}; choose from {', '.join(POLICIES)}")
