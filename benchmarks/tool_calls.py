"""Function calling on a real model (issue 70, part 3): valid calls, τ and tokens/s, with and without the grammar
proposer.

Starts ``specmesh serve MODEL --port P`` as a child process (the arguments after ``--``, MODEL first), ready once
/health answers, then sends every prompt of ``--prompts`` (``benchmarks/data/tool_prompts.jsonl``: 20 requests
for one of three tools) as a chat completion with the three ``TOOLS``, ``tool_choice`` as ``--tool-choice``
(default ``required``), greedy, ``max_tokens`` = ``--max-new-tokens``, one request at a time, once per method of
``--methods`` (``extra_body={"proposer": METHOD}``; ``default`` sends none: the server's default proposer). Per method: the calls that are valid (each call's name is a tool and its
arguments parse as JSON and validate against that tool's schema, ``jsonschema``), τ (pooled: (tokens - requests) /
steps, from each response's ``specmesh`` stats), tokens/s (completion tokens / the method's wall time) and
whether every method's calls equal the first method's (greedy: the same constrained output).

    python benchmarks/tool_calls.py --json benchmarks/results/tool_calls.json -- \\
        ~/.cache/specmesh-bench/smollm2-135m-instruct/hf --threads 1

A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specmesh_app.local_mesh import ServiceProcess  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks/data/tool_prompts.jsonl"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current local time in a city or time zone.",
        "parameters": {"type": "object", "properties": {"place": {"type": "string", "maxLength": 40}},
                       "required": ["place"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 60}},
                       "required": ["expression"], "additionalProperties": False}}},
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def valid(call: dict) -> bool:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    function = call.get("function") or {}
    if function.get("name") not in schemas:
        return False
    try:
        jsonschema.validate(json.loads(function.get("arguments") or ""), schemas[function["name"]])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_method(url: str, model: str, prompts: list[str], method: str, choice, max_tokens: int) -> dict:
    calls, tokens, steps, requests, valid_calls, replies = [], 0, 0, 0, 0, 0
    started = time.perf_counter()
    for prompt in prompts:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
                "tool_choice": choice, "max_tokens": max_tokens, "temperature": 0}
        if method != "default":
            body["proposer"] = method
        answer = post(url + "/v1/chat/completions", body)
        message = answer["choices"][0]["message"]
        made = message.get("tool_calls") or []
        calls.append([(c["function"]["name"], c["function"]["arguments"]) for c in made])
        replies += bool(made)
        valid_calls += bool(made) and all(valid(c) for c in made)
        tokens += answer["usage"]["completion_tokens"]
        steps += answer["specmesh"]["steps"]
        requests += 1
    seconds = time.perf_counter() - started
    return {"requests": requests, "with_calls": replies, "valid": valid_calls, "tokens": tokens,
            "tau": round((tokens - requests) / steps, 3) if steps else None,
            "tokens_per_s": round(tokens / seconds, 2), "seconds": round(seconds, 2), "calls": calls}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--methods", nargs="+", default=["grammar", "none", "fused"],
                   help="proposers (none: plain decoding; default: name none, the server's default)")
    p.add_argument("--tool-choice", default="required", help='"required", "auto" or a function\'s name')
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not serve_args:
        p.error("give serve's arguments after --, MODEL first")
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    choice = args.tool_choice
    if choice not in ("required", "auto", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    port = free_port()
    extra = ["--enable-auto-tool-choice"] if choice == "auto" else []
    server = ServiceProcess(["-m", "specmesh", "serve", *serve_args, "--port", str(port), "--disable-log-requests",
                             *extra], name="serve", listen="").wait_ready(900)
    url = f"http://127.0.0.1:{port}"
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        post(url + "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                            "tools": TOOLS, "tool_choice": choice, "max_tokens": 8})  # untimed
        methods = {m: run_method(url, model, prompts, m, choice, args.max_new_tokens) for m in args.methods}
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{exc}: {exc.read().decode()}") from None
    finally:
        server.stop()
    first = next(iter(methods.values()))["calls"]
    for report in methods.values():
        report["same_calls_as_first"] = report["calls"] == first
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "serve_args": serve_args,
              "tool_choice": args.tool_choice, "max_new_tokens": args.max_new_tokens, "prompts": str(args.prompts),
              "methods": methods}
    for name, r in methods.items():
        print(f"{name:>10}: {r['valid']}/{r['requests']} valid calls, tau {r['tau']}, {r['tokens_per_s']} tok/s, "
              f"same calls as {args.methods[0]}: {r['same_calls_as_first']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    return report


if __name__ == "__main__":
    main()
