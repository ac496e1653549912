"""Options of the orchestrator's commands: how it speculates (`specmesh serve` and the embedded commands), and
what an embedded command runs on (models, n-gram store, lookahead window)."""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter_service.arguments import add_store_argument
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, DEFAULT_RESTART_DEPTH, POLICIES
from specmesh import models
from verifier_service.arguments import add_lookahead_argument


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


LOOKAHEAD_HELP = ("for proposers that learn n-grams (lookahead, retrieval, fused with either): run lookahead "
                  "decoding's 2-D Jacobi window, N-1 levels of W guess tokens, beside every verified tree ((N-1)*W "
                  "extra rows per forward) and feed the N-grams it harvests to them; for retrieval N must exceed "
                  "the store's shortest context (2 by default) (default: off; lookahead runs its own window, "
                  "--proposer lookahead:window=W,ngram=N)")


def add_embedded_arguments(p: argparse.ArgumentParser) -> None:
    """What an embedded command runs on: the models, the n-gram store, the verifier's lookahead window."""
    add_model_arguments(p)
    add_store_argument(p)
    add_lookahead_argument(p, LOOKAHEAD_HELP)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model options of `generate` and `bench`: a target and an optional draft in this process."""
    models.add_target_arguments(p)
    p.add_argument("--draft", type=Path, default=None,
                   help="draft model directory for the draft_model proposers (default: the bundled demo draft "
                        "when --target is not given, else none)")
    models.add_draft_dtype_argument(p, "else --dtype")
    models.add_runtime_arguments(p)


def resolve_models(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(target, draft or None) directories of `generate` / `bench`: the demo pair unless --target is given."""
    target, draft = args.target, args.draft
    if target is None:
        target = models.demo_model("target")
        draft = draft if draft is not None else models.demo_model("draft")
    try:
        return models.model_dir(target), None if draft is None else models.model_dir(draft)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None


def check_embedded_options(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """What an embedded command's options name, checked before torch and transformers load (a second instead of
    ten): the model directories (or hub ids), the device's name. SystemExit with one line; else the resolved
    (target, draft) directories (``resolve_models``)."""
    resolved = resolve_models(args)
    try:
        models.check_device_name(getattr(args, "device", None))
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    return resolved
