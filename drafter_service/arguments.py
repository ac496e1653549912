"""The drafter's user-facing options, shared by `specmesh drafter` and the embedded commands."""

from __future__ import annotations

import argparse


def add_store_argument(p: argparse.ArgumentParser) -> None:
    """Where store-backed proposers (retrieval, fused mixes) keep their n-grams."""
    p.add_argument("--ngram-store", default=None, metavar="SPEC",
                   help="n-gram store of the retrieval proposer (also inside fused mixes): 'memory' (the default: "
                        "empty, learns from the requests of this process), a snapshot file written by `specmesh "
                        "ingest --out`, or a Redis URL (redis://HOST:PORT/DB) shared by every drafter replica, "
                        "which falls back to memory while Redis is down")


def add_members_argument(p: argparse.ArgumentParser) -> None:
    from drafter_service.fusion import DEFAULT_MEMBERS

    p.add_argument("--members", default=None, metavar="A+B+...",
                   help="proposers whose trees the 'fused' proposer merges, e.g. copy+retrieval+draft_model "
                        f"(default: {'+'.join(DEFAULT_MEMBERS)})")


def proposers_help() -> str:
    """One line per registered proposer, with its default budget, for --help."""
    from drafter_service.proposer import proposer_names, proposer_spec

    specs = [proposer_spec(name) for name in proposer_names()]
    return "; ".join(f"{s.name} ({s.help}; {s.max_nodes}x{s.max_depth})" for s in specs)
