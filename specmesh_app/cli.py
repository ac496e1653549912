"""The ``specmesh`` command line: generate, bench, ingest, train-pair, and the servers.

Only the command being run defines its options (and imports what they need), so ``--help``,
``--version`` and every usage error answer at once, in one line, before any model is loaded.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specmesh.host_runtime import tune_host_allocator
from specmesh.models import int_at_least, positive_int
from specmesh.sampling import GREEDY_BELOW

non_negative_int = int_at_least(0)


class OneLineErrors(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of `generate` is 20 lines; --help has it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------ generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    from drafter_service.arguments import add_members_argument, proposers_help
    from drafter_service.proposer import DEFAULT_PROPOSER, DEFAULT_PROPOSER_WHY, proposer_names
    from orchestrator.arguments import (
        add_embedded_arguments,
        add_grammar_arguments,
        add_penalty_arguments,
        add_speculation_arguments,
    )
    from specmesh.sampling import DEFAULT_MJSD_THRESHOLD

    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input, UTF-8)")
    add_embedded_arguments(p)
    add_members_argument(p)
    p.add_argument("--falcon", default=None, metavar="DIR",
                   help="a trained Falcon head (`specmesh train-falcon`) for the target: drafts with the falcon "
                        "proposer and this head in this process, or as a member of fused (--members ...+falcon; "
                        "with --server the drafter replica holds the head: `specmesh drafter --target DIR --falcon "
                        "DIR`; ask for --proposer falcon)")
    p.add_argument("--proposer", default=None, choices=proposer_names() + ["none"], metavar="NAME",
                   help="how drafts are made, with its default budget (nodes x depth): " + proposers_help() +
                        f"; 'none' = plain autoregressive decoding (default: {DEFAULT_PROPOSER}: "
                        f"{DEFAULT_PROPOSER_WHY})")
    p.add_argument("--max-nodes", type=non_negative_int, default=None,
                   help="tree budget: nodes per step (default: the proposer's)")
    p.add_argument("--max-depth", type=non_negative_int, default=None,
                   help="tree budget: depth per step (default: the proposer's)")
    add_speculation_arguments(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=non_negative_int, default=0,
                   help="sample among the k most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--mjsd-threshold", type=float, default=None, metavar="T",
                   help="--proposer mjsd (LOSSY, greedy only): accept the longest drafted prefix whose joint "
                        "likelihood ratio p/q under target and draft is at least T (default: "
                        f"{DEFAULT_MJSD_THRESHOLD}, chosen by measurement)")
    add_penalty_arguments(p)
    add_grammar_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--compare-ar", action="store_true",
                   help="after the streamed run, run the method again --repeats times interleaved with as many runs "
                        "of plain autoregressive decoding (all warm, none streamed, each with a fresh proposer), and "
                        "report the median speedup with its spread and whether outputs match")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="with --compare-ar: runs of each, interleaved (default: 3)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout and nothing else: text, token_ids, finish_reason, proposer, "
                        "server, stats (prompt_tokens, generated_tokens, steps, tau, tokens_per_second, "
                        "total_seconds, acceptance_per_position, draft_errors, acceptance, lossy) and, with "
                        "--compare-ar, compare_ar; the same in both modes")
    r = p.add_argument_group("remote", "generate through a running `specmesh serve` instead of in this process "
                                       "(model options are then the server's business and ignored)")
    r.add_argument("--server", default=None, metavar="HOST:PORT", help="address of `specmesh serve`")
    r.add_argument("--token-file", type=Path, default=None,
                   help="file holding the server's bearer token (default: $SPECMESH_TOKEN)")
    r.add_argument("--tls-ca", type=Path, default=None, help="PEM CA that signed the server's certificate (TLS)")
    r.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mutual TLS)")
    r.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    r.add_argument("--timeout", type=float, default=None, help="deadline of the request in seconds (default: none)")
    r.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait for the server to become ready, e.g. while it starts (default: 60)")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        prompt = args.prompt
    elif sys.stdin is None or sys.stdin.isatty():  # nothing piped: reading would wait silently for Ctrl-D
        print("specmesh generate: give a PROMPT argument or pipe one on standard input (see specmesh generate "
              "--help)", file=sys.stderr)
        raise SystemExit(2)
    else:
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SystemExit(f"specmesh generate: standard input is not UTF-8 text (byte {exc.start})") from None
    if not prompt:
        raise SystemExit("specmesh generate: empty prompt")
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from drafter_service.proposer import DEFAULT_PROPOSER
    from orchestrator.arguments import grammar_option, penalty_options
    from specmesh.sampling import SamplingParams

    prompt = read_prompt(args)
    try:
        sampling = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
            grammar=grammar_option(args), **penalty_options(args),
        )
    except ValueError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    proposer = args.proposer or ("falcon" if getattr(args, "falcon", None) else DEFAULT_PROPOSER)
    if proposer == "fused":
        from drafter_service.fusion import parse_members

        try:
            falcon_member = "falcon" in parse_members(args.members)
        except ValueError as exc:
            raise SystemExit(f"specmesh generate: {exc}") from None
    else:
        falcon_member = False
    if getattr(args, "falcon", None) and proposer != "falcon" and not falcon_member:
        raise SystemExit("specmesh generate: --falcon is for --proposer falcon (or fused with --members ...+falcon)")
    if getattr(args, "falcon", None) and args.server:  # the head is loaded where it drafts
        raise SystemExit("specmesh generate: with --server the drafter replica holds the Falcon head (`specmesh "
                         "drafter --proposers falcon --target DIR --falcon DIR`): ask for it with --proposer falcon")
    if args.members and proposer != "fused":
        raise SystemExit("specmesh generate: --members is for --proposer fused")
    from orchestrator.acceptance import request_sampling

    try:  # a lossy acceptance only with the proposer that asks for it; greedy only
        request_sampling(proposer, sampling, args.mjsd_threshold)
    except ValueError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    try:
        run = (_remote_runs if args.server else _embedded_runs)(args, prompt, sampling, proposer)
        return report(args, proposer, run)
    except ValueError as exc:  # e.g. a prompt longer than the target's context (from the warm-up on)
        raise SystemExit(f"specmesh generate: {exc}") from None


@dataclass
class Outcome:
    """One generation, as both modes report it."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "interrupted": Ctrl-C ended it
    stats: dict  # the keys of generate.proto's RequestStats
    seconds: float


class Interrupted(Exception):
    """Ctrl-C during a run: ``partial`` is what it generated until then."""

    def __init__(self, partial: Outcome) -> None:
        super().__init__("interrupted")
        self.partial = partial


INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report it


def report(args: argparse.Namespace, proposer: str, run) -> int:
    """Run the method (its text streamed to stdout unless --json), then with --compare-ar ``--repeats`` more runs
    of it interleaved with as many of plain decoding (neither streamed: like is timed with like), and print the
    stats line (stderr) or the JSON object (stdout). ``run(method, echo)`` -> Outcome, Interrupted on Ctrl-C:
    the stats so far are printed, marked ``finish=interrupted``, and the exit status is 130."""
    try:
        out, interrupted = run(proposer, echo=not args.json), False
    except Interrupted as stop:
        if not stop.partial.token_ids:
            raise KeyboardInterrupt from None  # nothing to report: main's one line
        out, interrupted = stop.partial, True
    s = out.stats
    line = (f"[specmesh] {'server=' + args.server + ' ' if args.server else ''}proposer={proposer} "
            f"tokens={s['generated_tokens']} steps={s['steps']} tau={s['tau']:.2f} "
            f"tok/s={s['tokens_per_second']:.1f} finish={out.finish_reason}"
            + (f" lossy ({s['acceptance']}): output differs from the target's own" if s.get("lossy") else ""))
    doc = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason, "proposer": proposer,
           "server": args.server, "stats": s}
    if args.compare_ar and not interrupted:
        ratios, same, rates, ar_rates = [], True, [], []
        try:
            for i in range(args.repeats):  # alternating which goes first: neither always runs after the other
                first, second = (proposer, "none") if i % 2 == 0 else ("none", proposer)
                runs = {first: run(first, echo=False)}
                runs[second] = run(second, echo=False)
                spec, ar = runs[proposer], runs["none"]
                ratios.append(ar.seconds / spec.seconds if spec.seconds else float("nan"))
                same &= ar.token_ids == spec.token_ids
                rates.append(spec.stats["tokens_per_second"])
                ar_rates.append(ar.stats["tokens_per_second"])
        except (Interrupted, KeyboardInterrupt):  # a run not streamed has nothing to show
            interrupted = True
        greedy = args.temperature < GREEDY_BELOW
        if ratios:
            median = statistics.median(ratios)
            doc["compare_ar"] = {"speedup_median": median, "speedup_min": min(ratios), "speedup_max": max(ratios),
                                 "repeats": len(ratios), "tokens_per_second": statistics.median(rates),
                                 "ar_tokens_per_second": statistics.median(ar_rates),
                                 "same_as_ar": same if greedy else None}
            line += (f" | compare-ar: tok/s={doc['compare_ar']['tokens_per_second']:.1f} "
                     f"ar tok/s={doc['compare_ar']['ar_tokens_per_second']:.1f} speedup={median:.2f}x "
                     f"[{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} interleaved runs]")
            if greedy:
                line += f" same_as_ar={same}"
        if interrupted:
            line += f" | compare-ar interrupted after {len(ratios)} of {args.repeats} runs"
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(line, file=sys.stderr)
    return INTERRUPTED if interrupted else 0


def _stats(summary: dict) -> dict:
    keys = ("prompt_tokens", "generated_tokens", "steps", "tau", "tokens_per_second", "total_seconds",
            "acceptance_per_position", "draft_errors", "acceptance", "lossy")
    return {k: summary[k] for k in keys}


# Untimed tokens each method generates on the prompt before the timed runs, as `specmesh bench` warms up: a
# process's first forwards pay one-off costs (torch's lazy initialisation, the allocator's first pages, kernel
# and thread-pool start-up), which made the first figure slower than the same run repeated.
WARMUP_TOKENS = 16


def _check_prompt_fits(target: Path, prompt: str, max_new_tokens: int) -> None:
    """The prompt's length against the target's context (``target``: its resolved directory), from its tokenizer
    and config.json before any model loads (the verifier checks it again, in the same words)."""
    from specmesh.checkpoint import read_config
    from specmesh.text_tokenizer import load_text_tokenizer

    context = read_config(target).get("max_position_embeddings")
    try:
        length = len(load_text_tokenizer(target).encode(prompt, verbose=False))
    except Exception:  # no tokenizer: the stack's load says so, in its own words
        return
    if context is not None and length + max_new_tokens > context:
        raise SystemExit(f"specmesh generate: prompt ({length} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the target's context of {context} positions")


def _embedded_runs(args: argparse.Namespace, prompt: str, sampling, proposer: str):
    import dataclasses

    from orchestrator.arguments import check_embedded_options

    target, _ = check_embedded_options(args)  # before the imports below: a bad path or device is told in a second
    _check_prompt_fits(target, prompt, sampling.max_new_tokens)
    from orchestrator.acceptance import request_sampling
    from orchestrator.embedded import load_stack
    from orchestrator.engine import GenerationResult
    from orchestrator.stats import RequestStats
    from orchestrator.stopping import TextStream

    args.prefix_caching = False  # every timed run prefills its prompt (the warm-up ran the same one)
    stack = load_stack(args)
    stack.profile_costs = False  # one request at a time: no load to size trees for
    options = {"members": args.members} if args.members else {}
    if getattr(args, "falcon", None):
        options["falcon.head" if proposer == "fused" else "head"] = args.falcon  # a member's, or its own

    def engine(name: str, **extra):
        """A fresh engine on the stack's engine core (the one every command runs), so no run drafts from what an
        earlier one taught a learning proposer."""
        try:
            return stack.engine(name, args.max_nodes, args.max_depth, overlap=args.overlap, policy=args.policy,
                                restart_depth=args.restart_depth, fresh=True,
                                **({**options, **extra} if name != "none" else {}))
        except ValueError as exc:
            raise SystemExit(f"specmesh generate: {exc}") from None

    def asked(name: str):
        return request_sampling(name, sampling, args.mjsd_threshold if name == proposer else None)

    methods = [proposer, "none"] if args.compare_ar and proposer != "none" else [proposer]
    warm_engines = [engine(name, store_spec="memory") for name in methods]  # the warm-up teaches no shared store
    prompt_ids = stack.tokenizer.encode(prompt, verbose=False)  # too long a prompt gets our own one-line error
    for name, warm in zip(methods, warm_engines, strict=True):
        warm.generate(prompt_ids, dataclasses.replace(asked(name), max_new_tokens=min(WARMUP_TOKENS,
                                                                                      sampling.max_new_tokens)))
    del warm_engines

    def run(name: str, echo: bool) -> Outcome:
        """Streamed to stdout as it comes when ``echo``; otherwise the text is decoded once at the end, so that
        the timed run is the engine's alone (as `bench` times it)."""
        result = GenerationResult([], "", RequestStats())
        text, pieces = TextStream(stack.decode, sampling.stop), []
        events = engine(name).stream(prompt_ids, asked(name), result)
        try:
            for event in events:
                if echo:
                    pieces.append(text.push(event.tokens, result.text_limit))
                    sys.stdout.write(pieces[-1])
                    sys.stdout.flush()
        except KeyboardInterrupt:
            events.close()  # its finally frees the session and records the stats so far
            raise Interrupted(finish(result, text, pieces, echo, "interrupted")) from None
        return finish(result, text, pieces, echo)

    def finish(result, text, pieces: list[str], echo: bool, reason: str | None = None) -> Outcome:
        if echo:
            pieces.append(text.flush(result.text_limit))
            if reason is None or "".join(pieces):  # the streamed text, if any, ends its line
                sys.stdout.write(pieces[-1] + "\n")
                sys.stdout.flush()
        else:  # never half a multi-byte character, as streamed text
            pieces = [stack.decode(result.token_ids)[: result.text_limit].rstrip("\ufffd")]
        return Outcome(result.token_ids, "".join(pieces), reason or result.finish_reason,
                       _stats(result.stats.summary()), result.stats.total_seconds)

    return run


def _remote_runs(args: argparse.Namespace, prompt: str, sampling, proposer: str):
    import grpc

    from specmesh.client import Client

    params = dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k, seed=sampling.seed, stop=list(sampling.stop), ignore_eos=sampling.ignore_eos,
                  overlap=args.overlap, policy=args.policy, restart_depth=args.restart_depth,
                  max_nodes=args.max_nodes, max_depth=args.max_depth,  # unset: the proposer's default budget
                  presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                  repetition_penalty=sampling.repetition_penalty, logit_bias=dict(sampling.logit_bias))
    if sampling.grammar is not None:  # the SDK's structured output options
        kind, spec = sampling.grammar
        params[kind] = True if kind == "json_object" else spec  # the SDK's keywords are the kinds' names
    from orchestrator.acceptance import acceptance_of
    try:
        client = Client(args.server, token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, timeout=args.timeout)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    try:
        client.wait_ready(args.connect_timeout)
    except TimeoutError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None

    def threshold(name: str) -> dict:
        return {"mjsd_threshold": args.mjsd_threshold} if name == proposer and args.mjsd_threshold else {}

    def run(name: str, echo: bool) -> Outcome:
        """Streamed when echoing (the server's request stats arrive only with the unary call), else unary."""
        start = time.perf_counter()
        try:
            if not echo:
                done = client.generate(prompt, proposer=name, **params, **threshold(name))
                return Outcome(done.token_ids, done.text, done.finish_reason, _stats(done.stats),
                               time.perf_counter() - start)
            ids, pieces, finish, steps = [], [], "", []
            chunks = client.stream(prompt, proposer=name, **params, **threshold(name))
            try:
                for chunk in chunks:
                    ids += chunk.token_ids
                    pieces.append(chunk.text)
                    steps += [chunk.step] if chunk.step is not None else []
                    finish = chunk.finish_reason or finish
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                chunks.close()  # cancels the call: the server frees the request's session
                raise Interrupted(streamed(name, ids, pieces, "interrupted", steps, start)) from None
        except grpc.RpcError as exc:
            raise SystemExit(f"specmesh generate: {exc.code().name}: {exc.details()}") from None
        return streamed(name, ids, pieces, finish, steps, start)

    def streamed(name: str, ids: list[int], pieces: list[str], finish: str, steps: list, start: float) -> Outcome:
        seconds = time.perf_counter() - start
        sys.stdout.write("\n")
        sys.stdout.flush()
        stats = {"generated_tokens": len(ids), "steps": len(steps),
                 "tau": sum(s.num_accepted + 1 for s in steps) / max(len(steps), 1),
                 "tokens_per_second": len(ids) / seconds if seconds else 0.0,
                 "acceptance": acceptance_of(name), "lossy": acceptance_of(name) != "exact"}
        return Outcome(ids, "".join(pieces), finish, stats, seconds)

    return run


# ---------------------------------------------------------------------- main
@dataclass(frozen=True)
class Command:
    help: str
    description: str
    arguments: str  # "module:function" that adds the command's options
    run: str  # "module:function" that runs it with the parsed arguments


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from orchestrator.arguments import add_embedded_arguments
    from specmesh_app import bench

    bench.add_arguments(p)  # bench's own options; the model options are shared with generate
    add_embedded_arguments(p)


COMMANDS = {
    "generate": Command("generate text with speculative decoding (embedded: one process, no servers)",
                        "Generate a continuation of PROMPT, streaming the text, then print one stats line (tokens, "
                        "tau = mean tokens committed per verification step, tokens/s measured after an untimed "
                        "warm-up, prefill included, as `specmesh bench` measures it; with --server, as this client "
                        "sees it) on stderr. Ctrl-C prints the stats so far (finish=interrupted) and exits with "
                        "status 130.",
                        "specmesh_app.cli:add_generate_arguments", "specmesh_app.cli:cmd_generate"),
    "bench": Command("measure speculative methods against autoregressive decoding and HF peers",
                     "Run every prompt of a JSONL file through AR and each method, interleaved, in one process; "
                     "print a markdown table and write JSON.",
                     "specmesh_app.cli:_bench_arguments", "specmesh_app.bench:run"),
    "train-pair": Command("train a small target/draft pair (Llama architecture, byte-level BPE)",
                          "Train a tokenizer, a target and a draft model on Python source files and save them in "
                          "Hugging Face format.",
                          "specmesh_app.train_pair:add_arguments", "specmesh_app.train_pair:run"),
    "train-cllm": Command("fine-tune a copy of a target into a consistency LLM (CLLM) for Jacobi decoding",
                          "Collect the target's Jacobi trajectories on a corpus and fine-tune a copy with the "
                          "global consistency loss plus the AR loss; saves a model directory (a different model "
                          "from its base: label it so).",
                          "specmesh_app.train_cllm:add_arguments", "specmesh_app.train_cllm:run"),
    "train-falcon": Command("train a Falcon semi-autoregressive draft head for a target (the `falcon` proposer)",
                            "Dump the target's final-layer features over a corpus, then train a head (LSTM + one "
                            "decoder layer on the target's embedding and LM head) with Coupled Sequential Glancing "
                            "Distillation; saves a head folder (config.json + model.safetensors) that "
                            "`--methods falcon:head=DIR` loads.",
                            "specmesh_app.train_falcon:add_arguments", "specmesh_app.train_falcon:run"),
    "ingest": Command("tokenize files and fill an n-gram store for retrieval drafting (REST)",
                      "Tokenize files (directories are walked) and add their n-grams to a Redis store or to a "
                      "snapshot file that drafters load with --ngram-store.",
                      "drafter_service.ingest:add_arguments", "drafter_service.ingest:run"),
    "verifier": Command("serve the target model: the Verifier gRPC service",
                        "Run a verifier replica: prefill, tree verification and KV caches of sessions.",
                        "verifier_service.server:add_arguments", "verifier_service.server:run"),
    "drafter": Command("serve proposers: the Drafter gRPC service",
                       "Run a drafter replica: one bidirectional stream per session, candidate trees out.",
                       "drafter_service.server:add_arguments", "drafter_service.server:run"),
    "serve": Command("serve a model over the OpenAI-compatible API (`serve MODEL`), or front replicas",
                     "`specmesh serve MODEL` loads MODEL (a Hugging Face directory, a .gguf file or a hub id) in "
                     "this process and serves it over the OpenAI-compatible HTTP API on --host:--port "
                     "(127.0.0.1:8000), as `vllm serve MODEL` does, vLLM's flags included; it answers /health once "
                     "warm. Without MODEL it is the orchestrator: the Generate gRPC service (and --http) over "
                     "verifier and drafter replicas (--verifier, --drafter), or over the models of --embedded.",
                     "orchestrator.server:add_arguments", "orchestrator.server:run"),
}


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def version() -> str:
    from specmesh import package_version

    return package_version() or "unknown (not installed)"


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the options of ``commands`` are defined (None: every command's)."""
    parser = OneLineErrors(prog="specmesh", description="specmesh: speculative decoding, drafters and verifiers as "
                                                        "services")
    parser.add_argument("--version", action="version", version=f"specmesh {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description)
        if commands is None or name in commands:
            _resolve(command.arguments)(p)
        p.set_defaults(func=lambda args, run=command.run: _resolve(run)(args))  # imported when it runs
    return parser


def main(argv: list[str] | None = None) -> int:
    """The program (``argv`` None: this process's arguments) or one command in-process (``argv`` given)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tune_host_allocator()  # host_runtime.py: no page faults on the step's tensors
    as_program, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    name = f"specmesh{' ' + command if command in COMMANDS else ''}"
    if as_program and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: interrupt(frame, name))
    try:
        args = build_parser([command] if command in COMMANDS else []).parse_args(argv)
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C anywhere (loading models, mid-run): one line, no traceback
        print(f"{name}: interrupted", file=sys.stderr)
        code = INTERRUPTED
    if code == INTERRUPTED and as_program:
        end_interrupted()
    return code


def interrupt(frame, name: str) -> None:
    """SIGINT in the program: KeyboardInterrupt, as by default, except while a module is being imported. Torch's
    import runs Python called from C++ (pybind11), where an exception ends the process in ``std::terminate``
    (SIGABRT, no message); there the one line and exit status 130 come at once (an import has nothing to
    unwind)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            print(f"{name}: interrupted", file=sys.stderr)
            end_interrupted()
        frame = frame.f_back
    raise KeyboardInterrupt


def end_interrupted() -> None:
    """End the process after a Ctrl-C, its stack unwound (every ``finally`` has run): at once, exit status 130.
    Not through the interpreter's exit, which joins threads (a drafting thread finishes its call first) and
    turns a Ctrl-C that landed in code run by ``eval``/``exec`` (torch and dataclasses do, while importing)
    into death by SIGINT however it was handled."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
