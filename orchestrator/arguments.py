"""How the orchestrator speculates: options of `specmesh serve` and of the embedded commands."""

from __future__ import annotations

import argparse

from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, DEFAULT_RESTART_DEPTH, POLICIES


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    """Overlap (PEARL), the policy, the pre-verify depth. Unset options take the defaults of
    orchestrator/policy.py or, through a server, the server's."""
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="PEARL: draft the next tree while the current one is verified "
                        f"(default: {'on' if DEFAULT_OVERLAP else 'off'})")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="speculation policy: static = the budget every step; adaptive = chosen per step from "
                        "acceptance and measured costs, with the budget as cap and 0 when drafting does not pay "
                        f"(default: {DEFAULT_POLICY})")
    p.add_argument("--restart-depth", type=int, default=None,
                   help="with --overlap and the static policy: depth of a tree the verifier has to wait for when "
                        "nothing drafted ahead was usable; 0 = it verifies the pending token alone while the "
                        f"drafter drafts ahead (default: {DEFAULT_RESTART_DEPTH})")
