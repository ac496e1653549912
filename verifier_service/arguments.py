"""The verifier's user-facing options, shared by `specmesh verifier` and the embedded commands."""

from __future__ import annotations

import argparse


def add_lookahead_argument(p: argparse.ArgumentParser, help: str) -> None:
    from verifier_service.lookahead import LookaheadConfig

    p.add_argument("--lookahead", type=LookaheadConfig.argument, default=None, metavar="W,N", help=help)
