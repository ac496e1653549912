"""What Ray Serve costs: the same greedy requests through the plain `specmesh serve` mesh and through the Ray
Serve application (specmesh_app/deploy.py), at 1 and 16 concurrent clients, on one machine.

    python benchmarks/ray_serve_overhead.py --target ../shared/models/stdlib-code/target \
        --draft ../shared/models/stdlib-code/draft --prompts ../shared/data/stdlib_functions.jsonl \
        --limit 32 --max-new-tokens 128 --proposer fused --json benchmarks/results/ray_serve_overhead.json

Both run at once, with the same processes behind them: one verifier, one drafter and one orchestrator
(`specmesh verifier`/`drafter`/`serve --http` as child processes; on Ray, the Verifier, Drafter and
Orchestrator deployments with one replica each, reached through Serve's HTTP proxy). Each concurrency level
runs the prompts on both, in rounds that alternate which goes first, after a warm-up. Per system and level:
tokens/s (generated tokens over the wall time of the round), p50/p99 request latency; and the per-request
overhead: the median latency difference of a 1-token request (prefill plus one token) sent alone. Outputs
are checked identical. Timings on a shared CPU are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from specmesh_app.bench import load_prompts
from specmesh_app.local_mesh import LocalMesh

MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, body: dict) -> tuple[float, str, int]:
    """(seconds, text, completion tokens) of one /v1/completions request."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - start, answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_round(url: str, prompts: list[str], body: dict, clients: int) -> dict:
    """All prompts through ``clients`` concurrent clients: latencies, texts, tokens and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: complete(url, {**body, "prompt": p}), prompts))
    wall = time.perf_counter() - start
    return {"wall": wall, "latencies": [r[0] for r in results], "texts": [r[1] for r in results],
            "tokens": sum(r[2] for r in results)}


def start_ray(args, verifier: list[str], drafter: list[str], serve_args: list[str]) -> str:
    import ray
    from ray import serve

    from specmesh_app.deploy import application

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # logical CPUs: scheduling only
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application({"verifier": verifier, "drafter": drafter, "serve": serve_args}), name="specmesh",
              route_prefix="/")
    return f"http://127.0.0.1:{port}/v1/completions"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL with a `prompt` field per line")
    p.add_argument("--limit", type=int, default=32, help="prompts per round (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--proposer", default="fused")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16], help="concurrency levels (default: 1 16)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per level and system (default: 2)")
    p.add_argument("--probes", type=int, default=30, help="1-token requests per system (default: 30)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    prompts = [row["prompt"] for row in load_prompts(args.prompts, args.limit)]
    verifier = ["--target", str(args.target), "--threads", str(args.threads)]
    drafter = ["--draft", str(args.draft), "--threads", str(args.threads)]
    serve_args = ["--proposer", args.proposer, "--model-name", MODEL, "--tokenizer", str(args.target)]
    http_port = free_port()
    mesh = LocalMesh(verifier, drafter, [*serve_args, "--http", f"127.0.0.1:{http_port}"])
    try:
        urls = {"mesh": f"http://127.0.0.1:{http_port}/v1/completions",
                "ray": start_ray(args, verifier, drafter, serve_args)}
        body = {"model": MODEL, "max_tokens": args.max_new_tokens, "temperature": 0}
        for url in urls.values():  # warm-up
            run_round(url, prompts[:4], body, 4)
        results: dict = {"levels": {}}
        mismatches = 0
        for clients in args.clients:
            level = {name: {"latencies": [], "wall": 0.0, "tokens": 0} for name in urls}
            reference = None
            for r in tqdm(range(args.rounds), desc=f"{clients} clients", file=sys.stderr):
                order = list(urls) if r % 2 == 0 else list(reversed(urls))
                for name in order:
                    out = run_round(urls[name], prompts, body, clients)
                    level[name]["latencies"] += out["latencies"]
                    level[name]["wall"] += out["wall"]
                    level[name]["tokens"] += out["tokens"]
                    reference = reference or out["texts"]
                    mismatches += sum(a != b for a, b in zip(reference, out["texts"], strict=True))
            results["levels"][clients] = {
                name: {"tokens_per_s": v["tokens"] / v["wall"], "p50_s": statistics.median(v["latencies"]),
                       "p99_s": percentile(v["latencies"], 0.99), "requests": len(v["latencies"])}
                for name, v in level.items()}
        probe = {**body, "max_tokens": 1, "prompt": prompts[0]}
        probes = {name: [] for name in urls}
        for i in tqdm(range(args.probes), desc="1-token requests", file=sys.stderr):
            for name in (list(urls) if i % 2 == 0 else list(reversed(urls))):
                probes[name].append(complete(urls[name], probe)[0])
        results["one_token_median_s"] = {name: statistics.median(v) for name, v in probes.items()}
        results["ray_overhead_ms_per_request"] = 1e3 * (results["one_token_median_s"]["ray"]
                                                         - results["one_token_median_s"]["mesh"])
        results["outputs_differ"] = mismatches
        results["config"] = {k: str(v) for k, v in vars(args).items()}
    finally:
        mesh.stop()
        try:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        except Exception:  # Ray never started
            pass
    print(f"{'clients':>7} {'system':>6} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7}")
    for clients, level in results["levels"].items():
        for name, v in level.items():
            print(f"{clients:>7} {name:>6} {v['tokens_per_s']:8.1f} {v['p50_s']:7.3f} {v['p99_s']:7.3f}")
    print(f"1-token request, median: mesh {results['one_token_median_s']['mesh'] * 1e3:.1f} ms, ray "
          f"{results['one_token_median_s']['ray'] * 1e3:.1f} ms (+{results['ray_overhead_ms_per_request']:.1f} ms); "
          f"outputs differ: {mismatches}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
