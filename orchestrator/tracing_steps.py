"""The speculation loop's spans: the prefill and one span per speculative step (specmesh/tracing.py).

A step span is current while the step's work runs, so the Verify call's client span (and through
propagation the verifier's server span) are its children, as is a drafter call a background worker
runs for it (drafter_link copies the context at submit). It ends before the step's tokens are
yielded: a generator must never hold a span's context across a ``yield``.
"""

from __future__ import annotations

from collections import Counter

from orchestrator.stats import StepStats

PREFILL_SPAN = "prefill"
STEP_SPAN = "speculative_step"
STEP = "specmesh.step."


def step_start_attributes(index: int, drafter: str) -> dict[str, object]:
    """What a step span knows as it starts: the step's number in its request (0 = the first after the
    prefill) and the drafter candidate in use ("" = none: the step verifies no tree)."""
    attrs: dict[str, object] = {STEP + "index": index}
    if drafter:
        attrs[STEP + "drafter"] = drafter
    return attrs


def step_attributes(step: StepStats) -> dict[str, object]:
    """A step's StepStats as ``specmesh.step.*`` span attributes: what was proposed and accepted, and where the
    time went. Its wall time is the span's duration; the rest of StepStats (drafter busy time, the pre-draft's
    depth and time) reaches clients with each step and is left out here: every attribute costs ~1.5 us to set
    and ~3 us to export."""
    per_source = sorted(Counter(step.proposed_sources).items())
    attrs: dict[str, object] = {
        STEP + "proposed": step.num_proposed,
        STEP + "tree_depth": step.tree_depth,
        STEP + "accepted": step.num_accepted,
        # 1 where the step's tree reached that position and the verifier accepted it, 0 where it was rejected
        STEP + "accepted_per_position": [1] * step.num_accepted + [0] * (step.tree_depth - step.num_accepted),
        STEP + "budget_nodes": step.budget[0],
        STEP + "budget_depth": step.budget[1],
        STEP + "predrafted": step.predrafted,
        STEP + "predraft_nodes": step.predraft_nodes,
        STEP + "predraft_used": step.predraft_used,
        STEP + "wait_ms": step.wait_seconds * 1e3,
        STEP + "verify_ms": step.verify_seconds * 1e3,
        STEP + "draft_ms": step.draft_seconds * 1e3,
        STEP + "batch_sessions": step.batch_sessions,
    }
    if per_source:  # aligned arrays: proposer names and the nodes each proposed
        attrs[STEP + "proposed_sources"] = [s for s, _ in per_source]
        attrs[STEP + "proposed_per_source"] = [n for _, n in per_source]
    if step.accepted_sources:
        attrs[STEP + "accepted_sources"] = list(step.accepted_sources)
    if step.draft_error:
        attrs[STEP + "draft_error"] = step.draft_error
    return attrs
