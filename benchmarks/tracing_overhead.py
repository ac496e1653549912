"""What tracing costs per speculative step: the same greedy requests with tracing on and off.

    python -m benchmarks.tracing_overhead [--prompts ../shared/data/stdlib_functions.jsonl] [--requests 24]
        [--max-new-tokens 64] [--proposer draft_model] [--json benchmarks/results/tracing_overhead_draft_model.json]

Spans go over OTLP/gRPC to a sink in this process that counts them (as a collector would receive them, in a process of its own).
Three measurements, each interleaving on and off so that load on the machine hits both alike:

1. ``span``: CPU time of one step span on this thread: start, the StepStats attributes, end, handed to
   the batch processor (its export runs on the processor's thread), against the API's no-op span;
2. ``embedded``: the embedded engine (demo pair, one process) with the SDK installed or not, requests
   alternating; per step = request time / steps;
3. ``mesh``: two meshes on loopback (verifier + drafter + serve each), one started with OTEL_* set (every
   process traces: step spans, gRPC client/server spans on both sides, drafter proposal spans), requests
   alternating between them through the client SDK; per step = request wall time / steps, and the steps'
   own wall time as serve measured it (StepInfo.step_ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.util._once import Once

from orchestrator.stats import StepStats
from orchestrator.tracing_steps import STEP_SPAN, step_attributes, step_start_attributes
from specmesh import tracing
from specmesh.models import demo_model

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path) as f:\n",
]


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that only counts what it receives; ``serve_sink`` runs one in its own
    process (so that receiving costs this process nothing)."""

    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.num_spans += n
        return trace_service_pb2.ExportTraceServiceResponse(
            partial_success=trace_service_pb2.ExportTracePartialSuccess(error_message=f"total {self.num_spans}"))


class SinkProcess:
    """A SpanSink in a child process; ``env`` points OTLP exporters at it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.tracing_overhead", "--serve-sink"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    @property
    def env(self) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}

    @property
    def num_spans(self) -> int:
        """Spans received so far (an empty export asks the sink)."""
        stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        reply = stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
        return int(reply.partial_success.error_message.split()[-1])

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def serve_sink() -> int:
    sink = SpanSink()
    print(sink.port, flush=True)
    sys.stdin.read()  # until the parent closes it
    return 0


def _otel_env(sink: SinkProcess, ratio: float) -> dict[str, str]:
    """OTEL_* for a traced process: export to ``sink``, keep a ``ratio`` of the traces (parent-based)."""
    env = {**sink.env, "OTEL_BSP_SCHEDULE_DELAY": "500"}
    if ratio < 1:
        env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)}
    return env


def _sdk_provider(sink: SinkProcess, ratio: float = 1.0):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)), shutdown_on_exit=False,
                              resource=Resource.create({"service.name": "tracing-overhead"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink.env["OTEL_EXPORTER_OTLP_ENDPOINT"],
                                                                    insecure=True)))
    return provider


def _use(provider) -> None:
    """Make ``provider`` (None: none, the API's no-op) this process's tracer provider. The API sets it once per
    process; a benchmark that toggles it resets that guard."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


# ------------------------------------------------------------------ 1. one span
def measure_span(sink: SinkProcess, rounds: int = 10, n: int = 500) -> dict:
    step = StepStats(num_proposed=12, tree_depth=4, num_accepted=2, accepted_sources=("draft_model",) * 2,
                     proposed_sources=("draft_model",) * 12, draft_seconds=0.003, verify_seconds=0.01,
                     budget=(12, 4), step_seconds=0.014, wait_seconds=0.001, predrafted=True, predraft_nodes=12)
    provider = _sdk_provider(sink)

    def once(flush) -> tuple[float, float]:
        """(CPU of this thread, CPU of the process with the export) per span."""
        t0, p0 = time.thread_time(), time.process_time()
        for i in range(n):
            with tracing.span(STEP_SPAN, step_start_attributes(i, "drafter")) as span:
                if span.is_recording():
                    span.set_attributes(step_attributes(step))
        t1 = time.thread_time()
        flush()  # the batch processor's export (serialising, sending) counts in the process's CPU
        return (t1 - t0) / n, (time.process_time() - p0) / n

    on, off = [], []
    for _ in range(rounds):
        _use(provider)
        on.append(once(provider.force_flush))  # the next round starts with an empty queue (it holds 2048 spans)
        _use(None)
        off.append(once(lambda: None))
    provider.shutdown()
    return {"on_us": statistics.median(t for t, _ in on) * 1e6,
            "on_with_export_us": statistics.median(p for _, p in on) * 1e6,
            "off_us": statistics.median(t for t, _ in off) * 1e6}


# ------------------------------------------------------------------ 2. embedded
def measure_embedded(sink: SinkProcess, prompts: list[str], requests: int, max_new: int, proposer: str,
                     ratio: float) -> dict:
    import torch

    from orchestrator.embedded import EmbeddedStack
    from specmesh.sampling import SamplingParams

    torch.set_num_threads(1)
    # the on and off requests of a pair share their prompt: each prefills it, as one request alone does
    stack = EmbeddedStack.load(demo_model("target"), demo_model("draft"), prefix_caching=False)
    stack.profile_costs = False  # one request at a time: no load to size trees for
    # on the stack's engine core, as `specmesh generate` runs; the defaults: drafting ahead (PEARL)
    engine = stack.engine(proposer, fresh=True)
    sampling = SamplingParams(max_new_tokens=max_new)
    provider = _sdk_provider(sink, ratio)
    per_step: dict[str, list[float]] = {"on": [], "off": []}
    per_request: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(requests * 2 + 2):
        mode = "on" if i % 2 == 0 else "off"
        _use(provider if mode == "on" else None)
        prompt = stack.tokenizer.encode(prompts[(i // 2) % len(prompts)])
        t0 = time.perf_counter()
        with tracing.request_span("text_completion", "demo", sampling, len(prompt)) as request:
            result = engine.generate(prompt, sampling, trace=request)  # the core records each step under it
        if i >= 2:  # the first pair warms up
            per_request[mode].append(time.perf_counter() - t0)
            per_step[mode].append(per_request[mode][-1] / max(1, result.stats.num_steps))
    _use(None)
    provider.shutdown()
    return {"on_ms_per_step": _median_ms(per_step["on"]), "off_ms_per_step": _median_ms(per_step["off"]),
            "on_ms_per_request": _median_ms(per_request["on"]), "off_ms_per_request": _median_ms(per_request["off"]),
            "requests_each": len(per_step["on"])}


# ------------------------------------------------------------------ 3. mesh
def measure_mesh(sink: SinkProcess, prompts: list[str], requests: int, max_new: int, proposer: str,
                 ratio: float) -> dict:
    from specmesh.client import Client
    from specmesh_app.local_mesh import LocalMesh

    common = ["--threads", "1"]
    meshes = {}
    try:
        meshes["on"] = LocalMesh(common, common, env=_otel_env(sink, ratio))
        meshes["off"] = LocalMesh(common, common)
        clients = {mode: Client(m.address, timeout=120) for mode, m in meshes.items()}
        wall: dict[str, list[float]] = {"on": [], "off": []}
        per_request: dict[str, list[float]] = {"on": [], "off": []}
        step_ms: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(requests * 2 + 4):
            mode = "on" if (i // 2) % 2 == (i % 2) else "off"  # on, off, off, on, on, off, ...
            t0 = time.perf_counter()
            chunks = list(clients[mode].stream(prompts[(i // 2) % len(prompts)], max_new_tokens=max_new,
                                               proposer=proposer))
            elapsed = time.perf_counter() - t0
            steps = [c.step for c in chunks if c.step is not None]
            if i >= 4:  # two of each warm up
                wall[mode].append(elapsed / max(1, len(steps)))
                per_request[mode].append(elapsed)
                step_ms[mode] += [s.step_ms / 1e3 for s in steps]
        for c in clients.values():
            c.close()
    finally:
        for m in meshes.values():
            m.stop()
    return {"on_ms_per_step": _median_ms(wall["on"]), "off_ms_per_step": _median_ms(wall["off"]),
            "on_step_ms_median": _median_ms(step_ms["on"]), "off_step_ms_median": _median_ms(step_ms["off"]),
            "on_ms_per_request": _median_ms(per_request["on"]), "off_ms_per_request": _median_ms(per_request["off"]),
            "requests_each": len(wall["on"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, default=None, help="JSONL with a prompt field (default: four built in)")
    p.add_argument("--requests", type=int, default=24, help="timed requests each, on and off (default: 24)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--proposer", default="draft_model")
    p.add_argument("--sample", type=float, default=1.0, metavar="RATIO",
                   help="share of the requests traced when on (OTEL_TRACES_SAMPLER=parentbased_traceidratio; "
                        "default 1: all)")
    p.add_argument("--only", choices=["span", "embedded", "mesh"], nargs="+", default=["span", "embedded", "mesh"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--serve-sink", action="store_true", help=argparse.SUPPRESS)  # SinkProcess's child
    args = p.parse_args(argv)
    if args.serve_sink:
        return serve_sink()
    prompts = PROMPTS
    if args.prompts is not None:
        prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()][:8]
    sink = SinkProcess()
    out: dict = {"sample": args.sample, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
                 "proposer": args.proposer}
    if "span" in args.only:
        out["span"] = measure_span(sink)
        r = out["span"]
        print(f"one step span: {r['on_us']:.1f} us of CPU on (SDK; {r['on_with_export_us']:.1f} us with its export), "
              f"{r['off_us']:.2f} us off")
    for name, fn in (("embedded", measure_embedded), ("mesh", measure_mesh)):
        if name in args.only:
            r = out[name] = fn(sink, prompts, args.requests, args.max_new_tokens, args.proposer, args.sample)
            delta = r["on_ms_per_step"] - r["off_ms_per_step"]
            r["overhead_ms_per_step"], r["overhead_percent"] = delta, 100 * delta / r["off_ms_per_step"]
            print(f"{name}: {r['on_ms_per_step']:.2f} ms/step on, {r['off_ms_per_step']:.2f} off: "
                  f"{delta:+.2f} ms ({r['overhead_percent']:+.1f}%); per request {r['on_ms_per_request']:.1f} ms on, "
                  f"{r['off_ms_per_request']:.1f} off; {r['requests_each']} requests each")
    out["spans_received"] = sink.num_spans
    sink.stop()
    print(f"spans received by the sink: {out['spans_received']}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
