"""What the front ends cost: the same greedy requests through gRPC, the OpenAI HTTP API (plain and streamed)
and, with --tracing, gRPC on a second `serve` exporting OpenTelemetry spans, all against one model setup.

    python benchmarks/front_end_overhead.py --target ../shared/models/stdlib-code/target \
        --draft ../shared/models/stdlib-code/draft --prompts ../shared/data/stdlib_functions.jsonl \
        --limit 16 --max-new-tokens 128 --proposer fused --tracing --json /tmp/front_end_overhead.json

`specmesh serve --embedded --http` runs as a child process (with --tracing a second one, with
OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP receiver in this process that counts the spans); the
prompts run through every front end in turn, the order rotated per prompt, after one warm-up round. Per
front end: median seconds per request, tokens/s pooled, and the median per-request difference against
gRPC on the same prompt (the outputs are checked identical). Timings on a shared CPU are noisy: compare
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import openai
from tqdm import tqdm

from specmesh.client import Client
from specmesh_app.bench import load_prompts
from specmesh_app.local_mesh import ServiceProcess

MODEL = "bench"


class SpanCounter:
    """An OTLP/gRPC trace receiver on 127.0.0.1 that counts the spans it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        counter = self
        self.spans = 0
        self._lock = threading.Lock()

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with counter._lock:
                    counter.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args, env: dict | None = None, name: str = "serve") -> tuple[ServiceProcess, str]:
    port = free_port()
    argv = ["-m", "specmesh", "serve", "--embedded", "--target", str(args.target), "--http", f"127.0.0.1:{port}",
            "--model-name", MODEL, "--threads", str(args.threads), "--dtype", args.dtype]
    if args.draft:
        argv += ["--draft", str(args.draft)]
    return ServiceProcess(argv, env, name).wait_ready(), f"http://127.0.0.1:{port}/v1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, default=None)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL with a `prompt` field per line")
    p.add_argument("--limit", type=int, default=16, help="prompts to use (default: 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--proposer", default="fused")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tracing", action="store_true", help="also a traced serve (OTLP to a receiver in this process)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    prompts = [row["prompt"] for row in load_prompts(args.prompts, args.limit)]
    plain, plain_url = start_serve(args)
    traced = receiver = None
    try:
        grpc_client = Client(plain.address, timeout=600)
        http_client = openai.OpenAI(base_url=plain_url, api_key="unused", max_retries=0, timeout=600)
        params = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, proposer=args.proposer)
        body = dict(model=MODEL, max_tokens=args.max_new_tokens, temperature=0, extra_body={"proposer": args.proposer})

        def via_grpc(client, prompt):
            c = client.generate(prompt, **params)
            return c.text, len(c.token_ids)

        steps: list[int] = []  # speculative steps per request (from the plain HTTP run's stats)

        def via_http(prompt):
            r = http_client.completions.create(prompt=prompt, **body)
            steps.append(r.model_extra["specmesh"]["steps"])
            return r.choices[0].text, r.usage.completion_tokens

        def via_http_stream(prompt):
            text, tokens = [], 0
            for chunk in http_client.completions.create(prompt=prompt, stream=True,
                                                        stream_options={"include_usage": True}, **body):
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return "".join(text), tokens

        runs = {"grpc": lambda q: via_grpc(grpc_client, q), "http": via_http, "http_stream": via_http_stream}
        if args.tracing:
            receiver = SpanCounter()
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_EXPORTER_OTLP_INSECURE":
                   "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}
            traced, _ = start_serve(args, env, "serve (traced)")
            traced_client = Client(traced.address, timeout=600)
            runs["grpc_traced"] = lambda q: via_grpc(traced_client, q)

        names = list(runs)
        for name in names:  # warm-up: one request each
            runs[name](prompts[0])
        seconds = {n: [] for n in names}
        tokens = {n: [] for n in names}
        mismatches = 0
        for i, prompt in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
            texts = {}
            for name in names[i % len(names):] + names[: i % len(names)]:
                start = time.perf_counter()
                texts[name], n = runs[name](prompt)
                seconds[name].append(time.perf_counter() - start)
                tokens[name].append(n)
            mismatches += len(set(texts.values())) > 1
        results = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "proposer": args.proposer,
                   "target": str(args.target), "outputs_differ": mismatches, "front_ends": {}}
        if receiver is not None:
            time.sleep(1.0)  # the last batch of spans
            results["spans_exported"] = receiver.spans
        for name in names:
            diffs = [a - b for a, b in zip(seconds[name], seconds["grpc"], strict=True)]
            results["front_ends"][name] = {
                "median_request_s": statistics.median(seconds[name]),
                "tokens_per_s": sum(tokens[name]) / sum(seconds[name]),
                "median_extra_ms_vs_grpc": 1e3 * statistics.median(diffs),
                "extra_ms_per_token_vs_grpc": 1e3 * sum(diffs) / max(sum(tokens[name]), 1),
                "extra_ms_per_step_vs_grpc": 1e3 * sum(diffs) / max(sum(steps[1:]), 1),
                "step_ms": 1e3 * sum(seconds[name]) / max(sum(steps[1:]), 1),
            }
        print(json.dumps(results, indent=2))
        print(f"{'front end':<12} {'median s/request':>17} {'tokens/s':>9} {'extra ms/request':>17} "
              f"{'extra ms/token':>15} {'extra ms/step':>14} {'ms/step':>8}", file=sys.stderr)
        for name, r in results["front_ends"].items():
            print(f"{name:<12} {r['median_request_s']:>17.3f} {r['tokens_per_s']:>9.1f} "
                  f"{r['median_extra_ms_vs_grpc']:>17.2f} {r['extra_ms_per_token_vs_grpc']:>15.3f} "
                  f"{r['extra_ms_per_step_vs_grpc']:>14.3f} {r['step_ms']:>8.2f}", file=sys.stderr)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        for proc in (plain, traced):
            if proc is not None:
                proc.stop()
        if receiver is not None:
            receiver.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
