"""The ``specmesh`` command line: generate, bench, ingest, train-pair, and the servers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"


def demo_model(kind: str) -> Path:
    """Path of the committed demo pair's ``target`` or ``draft`` model."""
    return DEMO_DIR / kind


# ------------------------------------------------------------------ generate
def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model options of `generate` and `bench`: a target and an optional draft in this process."""
    add_target_arguments(p)
    p.add_argument("--draft", type=Path, default=None,
                   help="draft model directory for the draft_model proposers (default: the bundled demo draft "
                        "when --target is not given, else none)")
    _add_draft_dtype_argument(p, "else --dtype")


def resolve_models(args: argparse.Namespace) -> tuple[Path, Path | None]:
    target, draft = args.target, args.draft
    if target is None:
        target = demo_model("target")
        draft = draft if draft is not None else demo_model("draft")
    return _model_dir(target, args.command), draft if draft is None else _model_dir(draft, args.command)


def torch_dtype(name: str):
    """torch dtype from its name ("float32", "bfloat16", ...); torch is imported only when needed."""
    import torch

    return getattr(torch, name)


def load_stack(args: argparse.Namespace):
    from orchestrator.embedded import EmbeddedStack

    _set_threads(args.threads)
    target, draft = resolve_models(args)
    return EmbeddedStack.load(
        target, draft, torch_dtype(args.dtype), resolve_draft_dtype(args.draft_dtype, args.dtype), runner=args.runner,
        store_spec=getattr(args, "ngram_store", None), lookahead=getattr(args, "lookahead", None),
    )


def _set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def _add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=["auto", "fast", "hf"], default="auto",
                   help="forward implementation: 'fast' = specmesh's lean Llama-family path, 'hf' = transformers; "
                        "'auto' picks fast where it applies (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")


def _add_draft_dtype_argument(p: argparse.ArgumentParser, otherwise: str) -> None:
    p.add_argument("--draft-dtype", choices=["auto", "float32", "bfloat16", "float64"], default="auto",
                   help="draft weights dtype; drafts never change the output, so a faster dtype is safe. "
                        f"'auto' = bfloat16 on CPUs with native bf16 matmul (AVX512-BF16/AMX), {otherwise}")


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """Model options of `specmesh verifier` (and the target half of generate/bench)."""
    p.add_argument("--target", type=Path, default=None,
                   help="target model: any local Hugging Face causal-LM directory (default: the bundled demo target)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32",
                   help="target weights dtype (default: float32)")
    _add_runtime_arguments(p)


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """Model options of `specmesh drafter`."""
    p.add_argument("--draft", default=None,
                   help="draft model directory for the draft_model proposers, or 'none' to serve model-free "
                        "proposers only (default: the bundled demo draft)")
    _add_draft_dtype_argument(p, "else float32")
    _add_runtime_arguments(p)


def _model_dir(path, command: str) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SystemExit(f"specmesh {command}: {path} is not a Hugging Face model directory (no config.json)")
    return path


def load_target_runner(args: argparse.Namespace):
    """(runner, model name) for `specmesh verifier`."""
    from specmesh.fast_llama import make_runner
    from specmesh.model_runner import load_model

    _set_threads(args.threads)
    path = _model_dir(args.target or demo_model("target"), args.command)
    return make_runner(load_model(path, torch_dtype(args.dtype)), args.runner), str(path)


def load_draft_runner(args: argparse.Namespace):
    """The draft runner of `specmesh drafter`, or None with --draft none."""
    from specmesh.fast_llama import make_runner
    from specmesh.model_runner import load_model

    _set_threads(args.threads)
    if args.draft is not None and str(args.draft).lower() == "none":
        return None
    path = _model_dir(args.draft or demo_model("draft"), args.command)
    return make_runner(load_model(path, resolve_draft_dtype(args.draft_dtype, "float32")), args.runner)


def resolve_draft_dtype(draft_dtype: str | None, dtype: str):
    from specmesh.model_runner import cpu_has_fast_bf16

    if draft_dtype in (None, "auto"):
        return torch_dtype("bfloat16" if cpu_has_fast_bf16() else dtype)
    return torch_dtype(draft_dtype)


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    """How the loop speculates: overlap (PEARL), the policy, the pre-verify depth. Unset options take
    the embedded defaults (orchestrator/embedded.py) or, through a server, the server's."""
    from orchestrator.embedded import DEFAULT_OVERLAP, DEFAULT_POLICY, DEFAULT_RESTART_DEPTH, POLICIES

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


def add_lookahead_argument(p: argparse.ArgumentParser) -> None:
    from verifier_service.lookahead import LookaheadConfig

    p.add_argument("--lookahead", type=LookaheadConfig.argument, default=None, metavar="W,N",
                   help="for proposers that learn n-grams (retrieval, fused with retrieval): run a Jacobi window "
                        "of W guess tokens beside every verified tree (W extra rows per forward) and feed the "
                        "N-grams it harvests to their n-gram store; N must exceed the store's shortest context "
                        "(2 by default) (default: off)")


def _add_generate(sub) -> None:
    from drafter_service.proposer import proposer_names

    p = sub.add_parser("generate", help="generate text with speculative decoding (embedded: one process, no servers)",
                       description="Generate a continuation of PROMPT, streaming the text, then print one stats line "
                                   "(tokens, tau = mean tokens committed per verification step, tokens/s) on stderr.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    _add_model_arguments(p)
    add_store_argument(p)
    add_lookahead_argument(p)
    add_members_argument(p)
    p.add_argument("--proposer", default=None, choices=proposer_names() + ["none"],
                   help="how drafts are made; 'none' = plain autoregressive decoding "
                        "(default: draft_model when a draft model is available, else prompt_lookup)")
    p.add_argument("--max-nodes", type=int, default=None, help="tree budget: nodes per step (default: per proposer)")
    p.add_argument("--max-depth", type=int, default=None, help="tree budget: depth per step (default: per proposer)")
    add_speculation_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--compare-ar", action="store_true",
                   help="also run plain autoregressive decoding and report the speedup and whether outputs match")
    p.add_argument("--json", action="store_true", help="print the full statistics as JSON on stdout at the end")
    r = p.add_argument_group("remote", "generate through a running `specmesh serve` instead of in this process "
                                       "(model options are then the server's business and ignored)")
    r.add_argument("--server", default=None, metavar="HOST:PORT", help="address of `specmesh serve`")
    r.add_argument("--token-file", type=Path, default=None,
                   help="file holding the server's bearer token (default: $SPECMESH_TOKEN)")
    r.add_argument("--tls-ca", type=Path, default=None, help="PEM CA that signed the server's certificate (TLS)")
    r.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mutual TLS)")
    r.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    r.add_argument("--timeout", type=float, default=None, help="deadline of the request in seconds (default: none)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from orchestrator.embedded import default_budget
    from specmesh.sampling import SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise SystemExit("specmesh generate: empty prompt")
    try:
        sampling = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    if args.server:
        return generate_remote(args, prompt)
    stack = load_stack(args)
    proposer = args.proposer or ("draft_model" if stack.draft_runner is not None else "prompt_lookup")
    nodes, depth = default_budget(proposer)
    if args.members and proposer != "fused":
        raise SystemExit("specmesh generate: --members is for --proposer fused")
    options = {"members": args.members} if args.members else {}
    try:
        engine = stack.engine(proposer, args.max_nodes or nodes, args.max_depth or depth, overlap=args.overlap,
                              policy=args.policy, restart_depth=args.restart_depth, **options)
    except ValueError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    prompt_ids = stack.tokenizer.encode(prompt)

    from orchestrator.engine import GenerationResult
    from orchestrator.stats import RequestStats
    from orchestrator.stopping import TextStream

    result = GenerationResult([], "", RequestStats())
    text = TextStream(stack.decode, sampling.stop)
    for event in engine.stream(prompt_ids, sampling, result):
        sys.stdout.write(text.push(event.tokens, result.text_limit))
        sys.stdout.flush()
    sys.stdout.write(text.flush(result.text_limit) + "\n")
    s = result.stats
    line = (f"[specmesh] proposer={proposer} tokens={s.num_generated} steps={s.num_steps} tau={s.tau:.2f} "
            f"tok/s={s.tokens_per_second:.1f} finish={result.finish_reason}")
    report = {"proposer": proposer, "stats": s.summary(), "finish_reason": result.finish_reason}
    if args.compare_ar:
        ar = stack.engine(None).generate(prompt_ids, sampling)
        speedup = ar.stats.total_seconds / s.total_seconds if s.total_seconds else float("nan")
        same = ar.token_ids == result.token_ids
        line += f" | ar tok/s={ar.stats.tokens_per_second:.1f} speedup={speedup:.2f}x"
        if sampling.greedy:
            line += f" same_as_ar={same}"
        report["ar"] = ar.stats.summary()
        report["speedup"] = speedup
    print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def generate_remote(args: argparse.Namespace, prompt: str) -> int:
    """`specmesh generate --server`: the same output and stats line, through the client SDK."""
    import time

    import grpc

    from specmesh.client import Client

    params = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  overlap=args.overlap, policy=args.policy, restart_depth=args.restart_depth)
    if args.max_nodes is not None or args.max_depth is not None:
        params.update(max_nodes=args.max_nodes or 8, max_depth=args.max_depth or 8)
    try:
        client = Client(args.server, token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, timeout=args.timeout)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None

    def run(proposer, echo: bool):
        ids, steps, finish, start = [], [], "", time.perf_counter()
        for chunk in client.stream(prompt, proposer=proposer, **params):
            ids += chunk.token_ids
            steps += [chunk.step] if chunk.step is not None else []
            finish = chunk.finish_reason or finish
            if echo:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        return ids, steps, finish, time.perf_counter() - start

    with client:
        try:
            ids, steps, finish, seconds = run(args.proposer, echo=True)
            sys.stdout.write("\n")
            tau = sum(s.num_accepted + 1 for s in steps) / max(len(steps), 1)
            line = (f"[specmesh] server={args.server} proposer={args.proposer or 'default'} tokens={len(ids)} "
                    f"steps={len(steps)} tau={tau:.2f} tok/s={len(ids) / seconds:.1f} finish={finish}")
            report = {"tokens": len(ids), "steps": len(steps), "tau": tau, "seconds": seconds, "finish_reason": finish,
                      "draft_errors": [s.draft_error for s in steps if s.draft_error]}
            if args.compare_ar:
                ar_ids, _, _, ar_seconds = run("none", echo=False)
                report["speedup"] = ar_seconds / seconds
                line += f" | ar tok/s={len(ar_ids) / ar_seconds:.1f} speedup={ar_seconds / seconds:.2f}x"
                if args.temperature == 0:
                    line += f" same_as_ar={ar_ids == ids}"
        except grpc.RpcError as exc:
            raise SystemExit(f"specmesh generate: {exc.code().name}: {exc.details()}") from None
    print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


# ----------------------------------------------------------------- servers
def _add_servers(sub) -> None:
    from drafter_service import server as drafter_server
    from orchestrator import server as orchestrator_server
    from verifier_service import server as verifier_server

    v = sub.add_parser("verifier", help="serve the target model: the Verifier gRPC service",
                       description="Run a verifier replica: prefill, tree verification and KV caches of sessions.")
    add_target_arguments(v)
    verifier_server.add_arguments(v)
    v.set_defaults(func=verifier_server.run)
    d = sub.add_parser("drafter", help="serve proposers: the Drafter gRPC service",
                       description="Run a drafter replica: one bidirectional stream per session, candidate trees out.")
    add_draft_arguments(d)
    drafter_server.add_arguments(d)
    d.set_defaults(func=drafter_server.run)
    s = sub.add_parser("serve", help="serve Generate over remote verifiers and drafters (the orchestrator)",
                       description="Run the orchestrator: the Generate gRPC service that clients and "
                                   "`specmesh generate --server` talk to.")
    orchestrator_server.add_arguments(s)
    s.set_defaults(func=orchestrator_server.run)


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description="specmesh: speculative decoding, drafters and verifiers as services")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from specmesh import bench, train_pair

    b = sub.add_parser("bench", help="measure speculative methods against autoregressive decoding and HF peers",
                       description="Run every prompt of a JSONL file through AR and each method, interleaved, in one "
                                   "process; print a markdown table and write JSON.")
    bench.add_arguments(b)  # bench's own options; the model options are shared with generate
    _add_model_arguments(b)
    add_store_argument(b)
    add_lookahead_argument(b)
    b.set_defaults(func=bench.run)
    t = sub.add_parser("train-pair", help="train a small target/draft pair (Llama architecture, byte-level BPE)",
                       description="Train a tokenizer, a target and a draft model on Python source files and save them "
                                   "in Hugging Face format.")
    train_pair.add_arguments(t)
    t.set_defaults(func=train_pair.run)
    from drafter_service import ingest

    i = sub.add_parser("ingest", help="tokenize files and fill an n-gram store for retrieval drafting (REST)",
                       description="Tokenize files (directories are walked) and add their n-grams to a Redis store "
                                   "or to a snapshot file that drafters load with --ngram-store.")
    ingest.add_arguments(i)
    i.set_defaults(func=ingest.run)
    _add_servers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
