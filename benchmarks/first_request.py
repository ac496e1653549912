"""Ready means ready: `specmesh serve MODEL`'s first request against its tenth (issue 70, part 1).

Starts ``specmesh serve MODEL --port P`` as a child process from this checkout's code or ``--repo DIR``'s
(``python -P -m specmesh`` with PYTHONPATH=DIR, so a checkout before the change compares with one script),
polls ``/health`` from the moment the process starts, and as soon as it answers 200 sends ``--requests``
streamed requests one after another (chat completions when the model has a chat template, ``--chat``; else
completions), greedy, ``max_tokens`` = ``--max-new-tokens``, each with its own prompt (``PROMPTS``, cycled: the
prefix cache does not serve a later one the first one's KV). Per request: time to the first streamed token and
the whole request's seconds. Reports seconds from start to /health 200, TTFT of request 1 and of request 10,
their ratio (the goal: <= 2) and the median TTFT of requests 2..N.

    python benchmarks/first_request.py --json benchmarks/results/first_request.json --name demo-after -- \\
        ../shared/models/stdlib-code/target --threads 1

The arguments after ``--`` go to serve (MODEL first). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specmesh_app.local_mesh import ServiceProcess  # noqa: E402

PROMPTS = ("def fibonacci(n):", "def is_prime(n):", "class Stack:", "def merge_sort(items):", "def gcd(a, b):",
           "def parse_args(argv):", "def read_lines(path):", "def flatten(nested):", "import os\n\ndef walk(root):",
           "def binary_search(items, x):", "def quicksort(items):", "def to_json(obj):")
START_TIMEOUT = 600.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def stream(url: str, model: str, prompt: str, max_tokens: int, chat: bool) -> tuple[float, float]:
    """One streamed greedy request: (seconds to its first token, seconds in all)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            text = choice[0].get("text") if not chat else (choice[0].get("delta") or {}).get("content")
            if first is None and choice and text:
                first = time.perf_counter() - started
    return (first if first is not None else float("nan")), time.perf_counter() - started


def run(repo: Path, serve_args: list[str], requests: int, max_tokens: int, chat: bool) -> dict:
    port = free_port()
    model = serve_args[0]
    argv = ["-P", "-m", "specmesh", "serve", *serve_args, "--port", str(port), "--disable-log-requests"]
    started = time.perf_counter()
    server = ServiceProcess(argv, {"PYTHONPATH": str(repo.resolve())}, "serve", listen="")
    url = f"http://127.0.0.1:{port}"
    try:
        while health(url) != 200:
            if server.proc.poll() is not None or time.perf_counter() - started > START_TIMEOUT:
                raise SystemExit(f"serve did not become healthy:\n{server.log_text()}")
            time.sleep(0.05)
        ready = time.perf_counter() - started
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        timings = [stream(url, model, PROMPTS[i % len(PROMPTS)], max_tokens, chat) for i in range(requests)]
    finally:
        server.stop()
    ttfts = [t for t, _ in timings]
    tenth = ttfts[min(9, len(ttfts) - 1)]
    return {"health_200_s": round(ready, 2), "ttft_s": [round(t, 4) for t in ttfts],
            "request_s": [round(s, 4) for _, s in timings], "first_ttft_s": round(ttfts[0], 4),
            "tenth_ttft_s": round(tenth, 4), "first_over_tenth": round(ttfts[0] / tenth, 2),
            "median_later_ttft_s": round(statistics.median(ttfts[1:]), 4) if len(ttfts) > 1 else None}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose code serve runs (default: this one)")
    p.add_argument("--requests", type=int, default=10, help="requests sent one after another (default: 10)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--chat", action="store_true", help="chat completions (the model has a chat template)")
    p.add_argument("--name", default="run", help="this run's entry in --json (other entries are kept)")
    p.add_argument("--json", type=Path, default=None, help="add this run to the report here")
    args = p.parse_args(own)
    if not serve_args:
        p.error("give serve's arguments after --, MODEL first")
    report = run(args.repo, serve_args, args.requests, args.max_new_tokens, args.chat)
    report.update(serve_args=serve_args, repo=str(args.repo), chat=args.chat, max_new_tokens=args.max_new_tokens,
                  date=datetime.datetime.now().isoformat(timespec="seconds"))
    print(json.dumps(report))
    if args.json is not None:
        runs = json.loads(args.json.read_text())["runs"] if args.json.exists() else {}
        runs[args.name] = report
        args.json.write_text(json.dumps({"runs": runs}, separators=(",", ":")) + "\n")
    return report


if __name__ == "__main__":
    main()
