"""The ``specmesh`` command line: generate, bench, ingest, train-pair, and the servers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from drafter_service.arguments import add_members_argument, proposers_help
from orchestrator.arguments import add_speculation_arguments
from specmesh.app.stack import add_embedded_arguments, load_stack


def _add_generate(sub) -> None:
    from drafter_service.proposer import proposer_names

    p = sub.add_parser("generate", help="generate text with speculative decoding (embedded: one process, no servers)",
                       description="Generate a continuation of PROMPT, streaming the text, then print one stats line "
                                   "(tokens, tau = mean tokens committed per verification step, tokens/s) on stderr.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    add_embedded_arguments(p)
    add_members_argument(p)
    p.add_argument("--proposer", default=None, choices=proposer_names() + ["none"], metavar="NAME",
                   help="how drafts are made, with its default budget (nodes x depth): " + proposers_help() +
                        "; 'none' = plain autoregressive decoding "
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
    if args.members and proposer != "fused":
        raise SystemExit("specmesh generate: --members is for --proposer fused")
    options = {"members": args.members} if args.members else {}
    try:
        engine = stack.engine(proposer, args.max_nodes, args.max_depth, overlap=args.overlap,
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
                  overlap=args.overlap, policy=args.policy, restart_depth=args.restart_depth,
                  max_nodes=args.max_nodes, max_depth=args.max_depth)  # unset: the proposer's default budget
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
    verifier_server.add_arguments(v)
    v.set_defaults(func=verifier_server.run)
    d = sub.add_parser("drafter", help="serve proposers: the Drafter gRPC service",
                       description="Run a drafter replica: one bidirectional stream per session, candidate trees out.")
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
    from specmesh.app import bench, train_pair

    b = sub.add_parser("bench", help="measure speculative methods against autoregressive decoding and HF peers",
                       description="Run every prompt of a JSONL file through AR and each method, interleaved, in one "
                                   "process; print a markdown table and write JSON.")
    bench.add_arguments(b)  # bench's own options; the model options are shared with generate
    add_embedded_arguments(b)
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
