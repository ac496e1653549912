"""Mixed-method load through `specmesh serve --embedded`: N concurrent OpenAI completions, each with its own proposer.

Starts ``specmesh serve --embedded --http 127.0.0.1:PORT`` as a child process (``ServiceProcess``, a free port,
ready once it answers /health; the arguments after ``--`` go to serve: ``--target``, ``--draft``, ``--threads``,
``--dtype``, ``--no-prefix-caching``), from this checkout's code or ``--repo DIR``'s (``python -P -m specmesh``
with PYTHONPATH=DIR, so two checkouts compare with one script). Then, with the official ``openai`` client:

1. the reference (``--reference serial``, the default): every prompt once with ``proposer: "none"`` at one request
   in flight, untimed: the target's own greedy output of each prompt;
2. a warm-up, untimed: one request per method at once (prompt 0, ``WARMUP_TOKENS`` tokens, as bench's warm-up);
3. the timed closed loop: ``--concurrency`` N client threads, each sending its next request when the last one
   returns, until the requests run out. The requests are the prompts (``--prompts``, ``--limit``) with the
   methods (``--methods``) assigned round-robin: ``--per-prompt all`` (default) runs every prompt with every
   method (prompt-major, so the N in flight are a mix of all methods), ``one`` runs prompt i with method
   i mod M. Each is greedy, ``max_tokens`` = ``--max-new-tokens``, ``extra_body={"ignore_eos": true,
   "proposer": METHOD}``, not streamed.

Reports the total tokens/s (completion tokens / the timed loop's wall time) and per method the requests, tokens,
mean latency, τ (pooled: (tokens - requests) / steps, from each response's ``specmesh`` stats, as bench's τ) and
greedy matches: each output's text against the serial reference of its prompt and, where the prompt also ran
with ``none`` in the same loop, against that output (batched with other methods' requests).

The same load through `specmesh bench --concurrency N` (``--bench BENCH.json``, a report of the same prompts,
``--max-new-tokens``, ``--ignore-eos`` and model options, ``ar`` being ``none``): bench runs one method at a time,
so it has a tokens/s per method, not for a mix. The mix's equivalent is the time bench needs to generate the same
tokens per method at N in flight, summed: ``bench_equivalent_tokens_per_s = sum_m T_m / sum_m (T_m / B_m)``
(T_m: this loop's tokens of method m; B_m: bench's tokens/s of m at N), the harmonic mean of bench's rates
weighted by the mix's tokens. With ``--per-prompt all`` and the prompts of bench's run, the mix's requests are
exactly the requests of bench's per-method runs, so the denominator is (to bench's rates) the sum of bench's wall
times. With one method this is that method's rate: a single-method run compares with bench's row directly.
``ratio_vs_bench`` = total tokens/s / that (issue 67 (e)'s goal: >= 0.9).

    python benchmarks/serve_load.py --prompts ../shared/data/stdlib_functions.jsonl --limit 32 --max-new-tokens 64 \
        --bench /tmp/bench32.json --json benchmarks/results/serve_load.json --name mixed -- \
        --target ../shared/models/stdlib-code/target --draft ../shared/models/stdlib-code/draft --threads 1 \
        --dtype float32 --no-prefix-caching

A benchmark, not a test (a minute or two per run on a CPU with the benchmark pair). With ``--name`` the JSON file
holds ``{"runs": {NAME: report, ...}, "bench": {BENCH.json's stem: its report, ...}}`` and a run replaces only its
own entries.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from benchmarks.kv_pressure import ROOT, free_port, get  # noqa: E402
from specmesh_app.bench import load_prompts  # noqa: E402
from specmesh_app.bench_load import WARMUP_TOKENS, closed_loop  # noqa: E402
from specmesh_app.local_mesh import ServiceProcess  # noqa: E402

MODEL = "serve-load"
METHODS = ("fused", "prompt_lookup_tree", "draft_model", "none")
HEALTH_TIMEOUT = 120.0


# --- the server -------------------------------------------------------------------------------------------------

def start_serve(repo: Path, serve_args: Sequence[str]) -> tuple[ServiceProcess, str]:
    """`specmesh serve --embedded --http` on a free loopback port from ``repo``'s code (``-P``: the working
    directory is not put before PYTHONPATH); (the process, its /v1 base URL) once /health answers 200."""
    port = free_port()
    argv = ["-P", "-m", "specmesh", "serve", "--embedded", "--http", f"127.0.0.1:{port}", "--model-name", MODEL,
            "--disable-log-requests", *serve_args]
    server = ServiceProcess(argv, {"PYTHONPATH": str(repo.resolve())}, "serve").wait_ready()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HEALTH_TIMEOUT
    while True:
        try:
            get(f"{base}/health")
            return server, f"{base}/v1"
        except OSError:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                log = server.log_text()
                server.stop()
                raise SystemExit(f"serve did not become healthy:\n{log}") from None
            time.sleep(0.2)


# --- requests ---------------------------------------------------------------------------------------------------

def plan_requests(num_prompts: int, methods: Sequence[str], per_prompt: str) -> list[tuple[int, str]]:
    """(prompt index, method) per request, in the order they are sent: the methods round-robin over the requests;
    ``all``: every prompt with every method, prompt-major; ``one``: prompt i with method i mod len(methods)."""
    if per_prompt == "all":
        return [(p, m) for p in range(num_prompts) for m in methods]
    return [(p, methods[p % len(methods)]) for p in range(num_prompts)]


def complete(client: openai.OpenAI, prompt: str, method: str, max_tokens: int) -> dict:
    """One greedy completion with ``method`` as its proposer: its text, tokens, steps, τ and seconds."""
    started = time.perf_counter()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True, "proposer": method})
    seconds = time.perf_counter() - started
    stats = (response.model_extra or {}).get("specmesh") or {}
    return {"method": method, "served_by": stats.get("proposer"), "text": response.choices[0].text,
            "tokens": response.usage.completion_tokens, "steps": stats.get("steps"), "tau": stats.get("tau"),
            "seconds": seconds}


def completions(client: openai.OpenAI, prompts: Sequence[str], requests: Sequence[tuple[int, str]],
                max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """``requests`` ((prompt index, method) each) in a closed loop of ``concurrency`` client threads (bench's
    ``closed_loop``); (records in request order, wall seconds from the first send to the last answer)."""
    def one(_index: int, request: tuple[int, str]) -> dict:
        prompt_index, method = request
        return {"prompt": prompt_index, **complete(client, prompts[prompt_index], method, max_tokens)}

    return closed_loop(requests, one, concurrency, "serve-load")


# --- figures ----------------------------------------------------------------------------------------------------

def per_method(records: Sequence[dict], methods: Sequence[str]) -> dict[str, dict]:
    """Per method: requests, tokens, mean latency, pooled τ ((tokens - requests) / steps: the first token is the
    prefill's, as bench counts it) and the greedy matches."""
    out = {}
    for method in methods:
        rows = [r for r in records if r["method"] == method]
        if not rows:
            continue
        tokens, steps = sum(r["tokens"] for r in rows), sum(r["steps"] or 0 for r in rows)
        checked = [r["matches_serial"] for r in rows if r.get("matches_serial") is not None]
        same_run = [r["matches_none_same_run"] for r in rows if r.get("matches_none_same_run") is not None]
        out[method] = {"requests": len(rows), "tokens": tokens, "mean_latency_s": sum(r["seconds"] for r in rows) / len(rows),
                       "tau": (tokens - len(rows)) / steps if steps else None,
                       "served_by": sorted({str(r["served_by"]) for r in rows}),
                       "greedy_match_serial": f"{sum(checked)}/{len(checked)}" if checked else None,
                       "greedy_match_none_same_run": f"{sum(same_run)}/{len(same_run)}" if same_run else None}
    return out


def bench_comparison(bench: dict, concurrency: int, methods: dict[str, dict], tokens_per_s: float) -> dict:
    """This loop against `specmesh bench --concurrency` (``bench``: its report): bench's rows at ``concurrency``,
    the time bench would need for this loop's tokens per method (sum of T_m / B_m) and the ratio (module doc)."""
    rows = {r["method"]: r for r in bench["load"]["rows"] if r["concurrency"] == concurrency}
    missing = [m for m in methods if ("ar" if m == "none" else m) not in rows]
    if missing:
        raise SystemExit(f"--bench: no row at concurrency {concurrency} for {missing} (bench has {sorted(rows)})")
    used = {m: rows["ar" if m == "none" else m] for m in methods}
    seconds = sum(methods[m]["tokens"] / used[m]["tokens_per_s"] for m in methods)
    equivalent = sum(v["tokens"] for v in methods.values()) / seconds
    return {"concurrency": concurrency,
            "rows": {m: {k: r.get(k) for k in ("method", "requests", "tokens", "wall_s", "tokens_per_s", "tau",
                                               "mean_batch", "greedy_match_ar")} for m, r in used.items()},
            "equivalent_seconds": seconds, "bench_equivalent_tokens_per_s": equivalent,
            "ratio_vs_bench": tokens_per_s / equivalent}


def table(report: dict) -> str:
    def fmt(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    bench = report.get("bench")
    lines = [f"{report['requests']} requests, N = {report['concurrency']}, {report['total_tokens']} tokens in "
             f"{report['wall_s']:.1f} s: {report['tokens_per_s']:.1f} tokens/s"
             + (f"; bench-equivalent {bench['bench_equivalent_tokens_per_s']:.1f} tokens/s, ratio "
                f"{bench['ratio_vs_bench']:.3f}" if bench else ""), "",
             "| method | requests | tokens | mean latency s | τ | bench tokens/s | bench τ | greedy = serial none | "
             "= none, same run |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, m in report["methods"].items():
        b = bench["rows"][method] if bench else {}
        lines.append(f"| {method} | {m['requests']} | {m['tokens']} | {fmt(m['mean_latency_s'])} | {fmt(m['tau'])} | "
                     f"{fmt(b.get('tokens_per_s'), 1)} | {fmt(b.get('tau'))} | {m['greedy_match_serial'] or '–'} | "
                     f"{m['greedy_match_none_same_run'] or '–'} |")
    return "\n".join(lines)


def text_digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# --- main -------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] [-- SERVE_OPTIONS...]")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL with `id` and `prompt` per line")
    p.add_argument("--limit", type=int, default=32, help="first N prompts (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="max_tokens of every request (default: 64)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"proposers, assigned round-robin ('none': plain decoding; default: {' '.join(METHODS)})")
    p.add_argument("--per-prompt", choices=["all", "one"], default="all",
                   help="all: every prompt with every method; one: prompt i with method i mod M (default: all)")
    p.add_argument("--reference", choices=["serial", "off"], default="serial",
                   help="serial: each prompt once with 'none' at one in flight first, the greedy reference "
                        "(default); off: only the same run's 'none' outputs")
    p.add_argument("--repo", type=Path, default=ROOT, help="checkout whose `specmesh serve` runs (default: this)")
    p.add_argument("--bench", type=Path, default=None,
                   help="a `specmesh bench --concurrency` JSON of the same load: compare (module doc)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--name", default=None, help="with --json: the run's key in the file's 'runs' (others kept)")
    args = p.parse_args(own)

    rows = load_prompts(args.prompts, args.limit)
    prompts = [row["prompt"] for row in rows]
    requests = plan_requests(len(prompts), args.methods, args.per_prompt)
    bench = json.loads(args.bench.read_text()) if args.bench else None
    server, base_url = start_serve(args.repo, serve_args)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
        reference: dict[int, str] = {}
        if args.reference == "serial":
            reference = {i: complete(client, q, "none", args.max_new_tokens)["text"] for i, q in enumerate(prompts)}
        warm = min(WARMUP_TOKENS, args.max_new_tokens)
        completions(client, prompts, [(0, m) for m in args.methods], warm, len(args.methods))
        records, wall = completions(client, prompts, requests, args.max_new_tokens, args.concurrency)
    finally:
        server.stop()

    same_run = {r["prompt"]: r["text"] for r in records if r["method"] == "none"}
    for r in records:
        r["matches_serial"] = r["text"] == reference[r["prompt"]] if r["prompt"] in reference else None
        r["matches_none_same_run"] = (r["text"] == same_run[r["prompt"]]
                                      if r["method"] != "none" and r["prompt"] in same_run else None)
        r["text_sha1"] = text_digest(r.pop("text"))
    total = sum(r["tokens"] for r in records)
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "repo": str(args.repo.resolve()), "serve_args": serve_args, "prompts_file": str(args.prompts),
        "limit": args.limit, "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
        "method_order": args.methods, "per_prompt": args.per_prompt, "reference": args.reference,
        "requests": len(records), "total_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
        "methods": per_method(records, args.methods),
    }
    if bench is not None:
        report["bench"] = {"file": args.bench.stem,
                           **bench_comparison(bench, args.concurrency, report["methods"], report["tokens_per_s"])}
    report["table"] = table(report)
    report["records"] = records
    print(report["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.name:
            stored = json.loads(args.json.read_text()) if args.json.exists() else {}
            stored.setdefault("runs", {})[args.name] = report
            if bench is not None:  # every bench report the runs compare with, by file name
                stored.setdefault("bench", {})[args.bench.stem] = bench
            args.json.write_text(json.dumps(stored, indent=1) + "\n")
        else:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
