"""Ray Serve autoscaling policies for the verifier and drafter pools (specmesh_app/deploy.py).

Serve's default policy counts the requests its handles route to a replica. Verifier and drafter replicas serve
gRPC sessions that the orchestrator opens directly (one request = one session for its whole life), which
Serve does not see; so each replica reports its own load (``record_autoscaling_stats``) and these policies
turn it into a replica count. Serve then applies the deployment's ``min_replicas``/``max_replicas``,
``upscale_delay_s``/``downscale_delay_s`` and the scaling factors around them.

- verifiers: sessions (decoding + waiting for KV room) against ``target_sessions`` per replica, and KV pool
  use against ``target_kv_usage``: the larger need wins (a few long contexts fill the pool before the
  session count says so);
- drafters: the share of time each replica's model thread spends drafting against ``target_busy`` (a
  drafter drafts one proposal at a time, so a busy thread is a queue), and, upward only, the mean proposal
  latency against ``target_latency_ms``.

Serve pickles this module by value into its controller: it imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# the metric names replicas report (specmesh_app/deploy.py)
SESSIONS, KV_USAGE = "sessions", "kv_usage"
DRAFT_LATENCY_MS, DRAFT_BUSY = "draft_latency_ms", "draft_busy"
AVERAGED_SIGNALS = (DRAFT_LATENCY_MS,)  # the policies take the mean over replicas of these, the sum of the others


def _totals(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> tuple[float, int]:
    """(sum over replicas, replicas reporting) of one metric."""
    values = list((metrics or {}).get(name, {}).values())
    return sum(values), len(values)


def verifier_replicas(current: int, metrics: Mapping[str, Mapping[Any, float]] | None, target_sessions: float,
                      target_kv_usage: float) -> int:
    """Replicas the verifier pool needs; ``metrics``: metric -> replica -> value averaged over Serve's look-back
    window. Without reports yet (replicas starting) the pool keeps its size."""
    sessions, reporting = _totals(metrics, SESSIONS)
    kv_usage, _ = _totals(metrics, KV_USAGE)
    if reporting == 0:
        return current
    return max(math.ceil(sessions / target_sessions), math.ceil(kv_usage / target_kv_usage))


def drafter_replicas(current: int, metrics: Mapping[str, Mapping[Any, float]] | None, target_busy: float,
                     target_latency_ms: float) -> int:
    """Replicas the drafter pool needs (see the module's docstring). Without reports yet it keeps its size."""
    busy, reporting = _totals(metrics, DRAFT_BUSY)
    if reporting == 0:
        return current
    need = math.ceil(busy / target_busy)
    latency, latency_reports = _totals(metrics, DRAFT_LATENCY_MS)
    if latency_reports and latency / latency_reports > target_latency_ms:
        need = max(need, math.ceil(current * latency / latency_reports / target_latency_ms))
    return need


class VerifierAutoscaling:
    """``autoscaling_config.policy: {policy_function: specmesh_app.autoscaling:VerifierAutoscaling,
    policy_kwargs: {target_sessions: 8, target_kv_usage: 0.7}}``."""

    def __init__(self, target_sessions: float = 8, target_kv_usage: float = 0.7) -> None:
        if target_sessions <= 0 or not 0 < target_kv_usage <= 1:
            raise ValueError("target_sessions must be > 0 and target_kv_usage in (0, 1]")
        self.target_sessions, self.target_kv_usage = target_sessions, target_kv_usage

    def __call__(self, ctx) -> tuple[int, dict]:
        return verifier_replicas(ctx.current_num_replicas, ctx.aggregated_metrics, self.target_sessions,
                                 self.target_kv_usage), {}


class DrafterAutoscaling:
    """``autoscaling_config.policy: {policy_function: specmesh_app.autoscaling:DrafterAutoscaling,
    policy_kwargs: {target_busy: 0.6, target_latency_ms: 20}}``."""

    def __init__(self, target_busy: float = 0.6, target_latency_ms: float = 20.0) -> None:
        if not 0 < target_busy <= 1 or target_latency_ms <= 0:
            raise ValueError("target_busy must be in (0, 1] and target_latency_ms > 0")
        self.target_busy, self.target_latency_ms = target_busy, target_latency_ms

    def __call__(self, ctx) -> tuple[int, dict]:
        return drafter_replicas(ctx.current_num_replicas, ctx.aggregated_metrics, self.target_busy,
                                self.target_latency_ms), {}
