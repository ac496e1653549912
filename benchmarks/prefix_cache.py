"""Multi-turn chat through the OpenAI API: the second turn's time to first token with and without the prefix cache.

Starts ``specmesh serve --embedded --http`` on 127.0.0.1 (a subprocess), once with the prefix cache (the default)
and once with ``--no-prefix-caching``, and runs ``--conversations`` two-turn chats one after another: turn 1 sends
a history of about ``--history`` tokens (a system prompt and a user message of source code) and streams a short
answer; turn 2 sends that history, the answer and a new question. Reports the median time to first token of
each turn (streamed: until the first content delta), their ratio, and the server's prefix-cache hit rate
(``specmesh_prefix_cache_hits_total`` / ``_queries_total``).

    python benchmarks/prefix_cache.py --json benchmarks/results/prefix_cache.json

A benchmark, not a test (a minute or two on a CPU with the demo target).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import sys
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_pressure import DEMO_TARGET, ROOT, embedded_serve, get  # noqa: E402

SHARED_DATA = ROOT.parent / "shared" / "data" / "stdlib_functions.jsonl"


def sources(count: int) -> list[str]:
    """``count`` different source texts: the stdlib functions of ../shared/data, else this repository's code."""
    if SHARED_DATA.exists():
        texts = [json.loads(line)["prompt"] for line in SHARED_DATA.read_text().splitlines() if line.strip()]
    else:
        texts = [p.read_text() for p in sorted((ROOT / "specmesh").glob("*.py"))]
    return [("\n".join(texts[i::count]))for i in range(count)]


def first_token_seconds(base: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Stream a chat completion: (seconds to the first content delta, the whole answer)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True})
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(base).netloc, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, text = None, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        delta = json.loads(line[5:])["choices"][0]["delta"].get("content")
        if delta:
            first = first if first is not None else time.perf_counter() - started
            text.append(delta)
    connection.close()
    return first, "".join(text)


def run(args, caching: bool) -> dict:
    options = ["--proposer", "none"] + ([] if caching else ["--no-prefix-caching"])
    with embedded_serve(ROOT, args.target, args.dtype, options) as (base, model):
        first_turn, second_turn = [], []
        chars = args.history * 3  # about 3 characters per token of code for the demo tokenizer
        for text in sources(args.conversations):
            history = [{"role": "system", "content": "You are a careful Python reviewer.\n"},
                       {"role": "user", "content": text[:chars] + "\nWhat does this code do?\n"}]
            seconds, answer = first_token_seconds(base, model, history, args.answer_tokens)
            first_turn.append(seconds)
            follow_up = history + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": "\nAnd how would you test it?\n"}]
            second_turn.append(first_token_seconds(base, model, follow_up, args.answer_tokens)[0])
        metrics = get(f"{base}/metrics")

    def counter(name: str) -> float:
        found = re.search(rf"^specmesh_{name}_total\{{[^}}]*\}} (\S+)", metrics, re.M)
        return float(found.group(1)) if found else 0.0

    queries, hits = counter("prefix_cache_queries"), counter("prefix_cache_hits")
    return {"prefix_caching": caching, "first_turn_ttft_s": round(statistics.median(first_turn), 4),
            "second_turn_ttft_s": round(statistics.median(second_turn), 4),
            "hit_rate": round(hits / queries, 3) if queries else 0.0, "hit_tokens": hits, "query_tokens": queries}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_TARGET, help="target model directory (default: demo)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--history", type=int, default=1500, help="history tokens of turn 1, about (default: 1500)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens of each answer (default: 32)")
    parser.add_argument("--conversations", type=int, default=8, help="two-turn chats, one after another (default: 8)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    cold, cached = run(args, caching=False), run(args, caching=True)
    result = {"target": str(args.target), "dtype": args.dtype, "history_tokens": args.history,
              "conversations": args.conversations, "without_cache": cold, "with_cache": cached,
              "second_turn_speedup": round(cold["second_turn_ttft_s"] / cached["second_turn_ttft_s"], 2)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
