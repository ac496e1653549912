"""Options of the orchestrator's commands: how it speculates (`specmesh serve` and the embedded commands), and
what an embedded command runs on (models, n-gram store, lookahead window)."""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter_service.arguments import add_store_argument
from drafter_service.draft_kv import add_draft_kv_argument
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, DEFAULT_RESTART_DEPTH, POLICIES
from specmesh import models
from specmesh.grammar_limits import add_grammar_limit_arguments
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


def add_penalty_arguments(p: argparse.ArgumentParser) -> None:
    """The logit processors (specmesh/logits_process.py): they change the target's distribution, and speculation
    stays exact under them. ``penalty_options`` turns them into SamplingParams fields."""
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: lower by P the logit of every token already in the output, in [-2, 2] "
                        "(default: 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: lower by F per occurrence in the output, in [-2, 2] (default: 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="CTRL's: divide the logit of a token of the prompt or output by R where positive, multiply "
                        "where negative, R > 0 (default: 1 = off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=VALUE",
                   help="add VALUE (in [-100, 100]) to token ID's logit (repeatable)")


def add_grammar_arguments(p: argparse.ArgumentParser) -> None:
    """Structured output (specmesh/grammar.py): at most one of them; ``grammar_option`` reads it."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE|JSON", default=None,
                       help="the output follows this JSON Schema (a file, or the schema itself)")
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", default=None, help="the output matches this regular expression")
    group.add_argument("--grammar", metavar="FILE|LARK", default=None,
                       help="the output follows this Lark grammar (a file, or the grammar itself)")


def grammar_option(args: argparse.Namespace) -> tuple[str, str] | None:
    """SamplingParams.grammar of ``add_grammar_arguments``' options; ValueError for an unreadable file."""
    def text(value: str) -> str:
        path = Path(value)
        try:
            return path.read_text() if len(value) < 4096 and path.is_file() else value
        except OSError as exc:
            raise ValueError(f"cannot read {value}: {exc}") from None

    if args.json_schema is not None:
        return "json_schema", text(args.json_schema)
    if args.json_object:
        return "json_object", ""
    if args.regex is not None:
        return "regex", args.regex
    if args.grammar is not None:
        return "lark", text(args.grammar)
    return None


def penalty_options(args: argparse.Namespace) -> dict:
    """SamplingParams fields of ``add_penalty_arguments``' options; ValueError for a malformed --logit-bias."""
    bias = []
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=VALUE, got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes ID=VALUE, got {item!r}")
    return dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, logit_bias=tuple(sorted(bias)))


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
    add_grammar_limit_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model options of `generate` and `bench`: a target and an optional draft in this process."""
    models.add_target_arguments(p)
    p.add_argument("--draft", type=Path, default=None,
                   help="draft model directory for the draft_model proposers (default: the bundled demo draft "
                        "when --target is not given, else none)")
    models.add_draft_dtype_argument(p, "else --dtype")
    add_draft_kv_argument(p)
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
        models.check_dtype_name(getattr(args, "dtype", None))
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    return resolved
