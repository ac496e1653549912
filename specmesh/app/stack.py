"""The embedded stack of `specmesh generate` and `specmesh bench`: its options, and the models loaded once."""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter_service.arguments import add_store_argument
from specmesh import models
from verifier_service.arguments import add_lookahead_argument

LOOKAHEAD_HELP = ("for proposers that learn n-grams (retrieval, fused with retrieval): run a Jacobi window of W guess "
                  "tokens beside every verified tree (W extra rows per forward) and feed the N-grams it harvests to "
                  "their n-gram store; N must exceed the store's shortest context (2 by default) (default: off)")


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


def load_stack(args: argparse.Namespace):
    from orchestrator.embedded import EmbeddedStack

    models.set_threads(args.threads)
    target, draft = resolve_models(args)
    try:
        device = models.resolve_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    return EmbeddedStack.load(
        target, draft, models.torch_dtype(args.dtype, device), models.draft_dtype(args.draft_dtype, args.dtype, device),
        runner=args.runner, attention=args.attention, store_spec=getattr(args, "ngram_store", None),
        lookahead=getattr(args, "lookahead", None), device=device, kv_cache_gb=getattr(args, "kv_cache_gb", None),
    )
