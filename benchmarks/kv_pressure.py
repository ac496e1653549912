"""KV pressure through the OpenAI API: N concurrent chat requests without ``max_tokens`` on a small KV pool.

Starts ``specmesh serve --embedded --http`` on 127.0.0.1 (a subprocess, from ``--repo``'s code: compare two
checkouts with one script), with a KV pool that holds ``--contexts`` full contexts of the target, and sends
``--requests`` chat completions at once, none with ``max_tokens`` (so each may run to the end of the context, as
OpenAI's default is). Reports how many completed and how many were refused (HTTP status counts), completion
tokens, finish reasons, wall time, tokens/s, and the server's preemption counter (``/metrics``).

    python benchmarks/kv_pressure.py --contexts 0.5 --json benchmarks/results/kv_pressure_halfctx_after.json
    python benchmarks/kv_pressure.py --repo ../before --json /tmp/before.json   # an older checkout's server

A benchmark, not a test: a run takes minutes on a CPU (the demo target's context is 2,048 tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "specmesh" / "demo_models" / "target"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the demo target has no chat template
PROMPTS = ["def parse_header(line):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "def merge_sorted(a, b):\n", "import os\n\ndef walk_files(root):\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes_per_token(target: Path, dtype: str) -> int:
    config = json.loads((target / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def chat(base: str, model: str, prompt: str, timeout: float) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
        return {"status": 200, "tokens": answer["usage"]["completion_tokens"],
                "finish_reason": answer["choices"][0]["finish_reason"], "seconds": time.perf_counter() - started}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "tokens": 0, "finish_reason": None, "seconds": time.perf_counter() - started,
                "error": exc.read().decode()[:200]}


@contextlib.contextmanager
def embedded_serve(repo: Path, target: Path, dtype: str, options: list[str]) -> Iterator[tuple[str, str]]:
    """``specmesh serve --embedded --http`` on a free 127.0.0.1 port, from ``repo``'s code, one torch thread, the
    plain chat template, with ``options`` added: yields (its base URL, the model id it serves) once it answers
    /health, and stops it after."""
    port = free_port()
    command = [sys.executable, "-m", "specmesh", "serve", "--embedded", "--target", str(target), "--dtype", dtype,
               "--threads", "1", "--http", f"127.0.0.1:{port}", "--chat-template", PLAIN_TEMPLATE,
               "--disable-log-requests", *options]
    env = dict(os.environ, PYTHONPATH=str(repo.resolve()))
    server = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                get(f"{base}/health")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"serve did not start:\n{server.stderr.read()[-2000:]}") from None
                time.sleep(0.2)
        yield base, json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
    finally:
        server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=ROOT, help="checkout whose `specmesh serve` runs (default: this)")
    parser.add_argument("--target", type=Path, default=DEMO_TARGET, help="target model directory (default: demo)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=32, help="concurrent chat requests (default: 32)")
    parser.add_argument("--contexts", type=float, default=4.0,
                        help="the KV pool holds this many full contexts of the target (default: 4)")
    parser.add_argument("--context", type=int, default=None,
                        help="the target's context in tokens (default: config.json's max_position_embeddings)")
    parser.add_argument("--proposer", default="none", help="serve's --proposer (default: none, plain decoding)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a request may take (default: 1800)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    config = json.loads((args.target / "config.json").read_text())
    context = args.context or config["max_position_embeddings"]
    pool_gb = args.contexts * context * kv_bytes_per_token(args.target, args.dtype) / 2**30
    options = ["--kv-cache-gb", f"{pool_gb:.6f}", "--proposer", args.proposer]
    with embedded_serve(args.repo, args.target, args.dtype, options) as (base, model):
        started = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            answers = list(pool.map(lambda i: chat(base, model, PROMPTS[i % len(PROMPTS)], args.timeout),
                                    range(args.requests)))
        wall = time.perf_counter() - started
        metrics = get(f"{base}/metrics")
    preemptions = re.search(r"^specmesh_num_preemptions_total\{[^}]*\} (\S+)", metrics, re.M)
    tokens = sum(a["tokens"] for a in answers)
    result = {
        "repo": str(args.repo.resolve()), "target": str(args.target), "dtype": args.dtype, "context": context,
        "pool_gb": pool_gb, "pool_contexts": args.contexts, "requests": args.requests, "proposer": args.proposer,
        "statuses": dict(Counter(a["status"] for a in answers)),
        "finish_reasons": dict(Counter(a["finish_reason"] for a in answers if a["status"] == 200)),
        "completed": sum(a["status"] == 200 for a in answers), "completion_tokens": tokens,
        "wall_seconds": round(wall, 2), "tokens_per_second": round(tokens / wall, 1),
        "preemptions": float(preemptions.group(1)) if preemptions else None,
        "errors": sorted({a["error"] for a in answers if "error" in a})[:3],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
