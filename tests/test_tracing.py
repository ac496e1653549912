"""OpenTelemetry tracing (specmesh/tracing.py): off without OTEL_* variables; step spans of the engine in
memory; and a real three-process mesh exporting to an OTLP receiver started here, with one connected trace
per request holding serve's request and step spans, the verifier's calls and the drafter's proposals."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import grpc
import pytest
import service_helpers as sh
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from otlp_helpers import OtlpReceiver
from spec_helpers import ForwardingProposer, engine_for, greedy, make_prompts

from drafter_service.proposer import make_proposer
from orchestrator.tracing_steps import PREFILL_SPAN, STEP_SPAN, step_attributes
from specmesh import rpc, tracing
from specmesh.client import Client
from specmesh.text_tokenizer import load_text_tokenizer
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.server import VERIFY_ITEM_SPAN

ROOT = Path(__file__).resolve().parents[1]


def _install_provider(provider: TracerProvider | None) -> None:
    # the API lets a process set its tracer provider once; tests put it back (as opentelemetry-test-utils does)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def memory_spans():
    """An SDK provider recording finished spans in memory, the global one for the test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _install_provider(provider)
    try:
        yield exporter
    finally:
        _install_provider(None)
        provider.shutdown()


def _no_otel_env(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


# ------------------------------------------------------------------ off by default
@pytest.mark.parametrize("env,want", [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_BSP_SCHEDULE_DELAY": "10"}, []),  # settings alone ask for nothing
])
def test_the_standard_variables_decide(env, want):
    assert tracing.requested_exporters(env) == want


def test_without_otel_variables_nothing_is_set_up(monkeypatch):
    """No OTEL_* variables: no provider, and servers and channels get no tracing interceptor (zero cost)."""
    _no_otel_env(monkeypatch)
    assert tracing.setup_tracing("specmesh-test") is False
    assert not tracing.enabled()
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    assert tracing.server_interceptors() == [] and tracing.aio_channel_interceptors() == []
    made = []
    monkeypatch.setattr(grpc.aio, "server", lambda **kw: made.append(kw))
    rpc.new_server(rpc.Security())
    rpc.new_server(rpc.Security(tokens=("t",)))
    assert [[type(i) for i in kw["interceptors"]] for kw in made] == [
        [rpc.DecodeErrorInterceptor], [rpc.BearerTokenInterceptor, rpc.DecodeErrorInterceptor]]
    channel = rpc.insecure_or_secure_channel("127.0.0.1:1", rpc.Security(), rpc.channel_options())
    assert type(channel).__module__ == "grpc._channel"  # gRPC's own channel, not an intercepting wrapper
    channel.close()
    aio_calls = []
    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda address, **kw: aio_calls.append(kw))
    rpc.insecure_or_secure_channel("127.0.0.1:1", rpc.Security(), [], aio=True)
    assert aio_calls[0]["interceptors"] is None
    with tracing.span("anything") as span:  # the API's no-op span: nothing records
        assert not span.is_recording()


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)


SETUP = """
from opentelemetry import trace
from specmesh import rpc, tracing
assert tracing.setup_tracing("specmesh-probe")
print(trace.get_tracer_provider().resource.attributes["service.name"])
print(trace.get_tracer_provider().resource.attributes["service.version"])
print(len(tracing.server_interceptors()), len(tracing.aio_channel_interceptors()))
print(type(rpc.insecure_or_secure_channel("127.0.0.1:1", rpc.Security(), [])).__name__)
with tracing.span("probe-span"):
    pass
"""


@pytest.mark.parametrize("env,service", [
    ({}, "specmesh-probe"),
    ({"OTEL_SERVICE_NAME": "named-by-env"}, "named-by-env"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=x"}, "from-attributes"),
])
def test_console_exporter_and_interceptors_when_asked(env, service):
    """Tracing on: the service name (ours unless OTEL_* names one), the gRPC interceptors, and spans flushed
    at exit."""
    out = _python(SETUP, {"OTEL_TRACES_EXPORTER": "console", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == service
    assert lines[1] == importlib.metadata.version("specmesh")  # service.version
    assert lines[2] == "1 4"  # the aio server interceptor; the four aio client interceptors
    assert lines[3] == "_InterceptorChannel"
    assert '"name": "probe-span"' in out.stdout  # the batch was exported at exit


@pytest.mark.parametrize("env,message", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin: specmesh exports spans with otlp, console"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTLP protocol 'http/json' is not supported"),
])
def test_bad_settings_are_one_line(env, message):
    out = _python("import argparse\nfrom specmesh import serving\n"
                  "serving.setup_tracing(argparse.Namespace(command='verifier'))", env)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(f"specmesh verifier: {message}")


def test_missing_extra_names_the_install_command():
    code = ("import sys\nsys.modules['opentelemetry.sdk'] = None  # as if the otel extra were not installed\n"
            "import argparse\nfrom specmesh import serving\n"
            "serving.setup_tracing(argparse.Namespace(command='drafter'))")
    out = _python(code, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("specmesh drafter: tracing is asked for") and "pip install 'specmesh[otel]'" in last


def test_http_protobuf_needs_its_exporter():
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        pytest.skip("the OTLP http exporter is installed")
    except ImportError:
        pass
    out = _python("from specmesh import tracing\ntracing.setup_tracing('x')",
                  {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert out.returncode == 1 and "pip install opentelemetry-exporter-otlp-proto-http" in out.stderr


@pytest.mark.parametrize("command,args", [
    ("verifier", []), ("drafter", ["--draft", "none"]), ("serve", ["--verifier", "127.0.0.1:1"]),
])
def test_servers_refuse_bad_tracing_settings_before_loading_anything(command, args):
    """Each server sets tracing up first thing in run(): a bad setting is one line, before any model loads.
    (serve: needs orchestrator/server.py to call serving.setup_tracing(args).)"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-m", "specmesh", command, *args, "--listen", "127.0.0.1:0"], cwd=ROOT,
                         env={**clean, "OTEL_TRACES_EXPORTER": "zipkin"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"specmesh {command}: OTEL_TRACES_EXPORTER=zipkin")


# ------------------------------------------------------------------ the engine's spans, in memory
class SpanRecorder(ForwardingProposer):
    """Records, for each proposal, the span current on the thread that runs it."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: list[tuple[int, str]] = []  # (current span id, thread name)

    def propose(self, state, budget):
        self.calls.append((trace.get_current_span().get_span_context().span_id, threading.current_thread().name))
        return self.inner.propose(state, budget)


def _attributes(attrs) -> dict:
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in dict(attrs).items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_spans_one_per_step_under_the_request(memory_spans, model_sets, overlap):
    ms = model_sets("cyclic")
    recorder = SpanRecorder(make_proposer("draft_model", draft_runner=ms.runner("near", "fast")))
    engine = engine_for(ms.runner("target", "fast"), recorder, max_nodes=6, max_depth=3)
    engine.overlap = overlap
    prompt = make_prompts(2, seed=7)[1]
    sampling = greedy(40)
    with tracing.request_span("text_completion", "tiny-target", sampling, len(prompt)) as request:
        result = engine.generate(prompt, sampling)
        tracing.record_request_result(request, result.finish_reason, len(result.token_ids), result.stats.summary())
    finished = memory_spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in finished:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == sorted(["text_completion tiny-target", PREFILL_SPAN, STEP_SPAN])

    (req,) = by_name["text_completion tiny-target"]
    assert req.parent is None
    attrs = _attributes(req.attributes)
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.provider.name"] == "specmesh"
    assert attrs["gen_ai.request.model"] == "tiny-target" and attrs["gen_ai.request.max_tokens"] == 40
    assert attrs["gen_ai.request.temperature"] == 0.0 and "gen_ai.request.seed" not in attrs
    assert attrs["gen_ai.usage.input_tokens"] == len(prompt)
    assert attrs["gen_ai.usage.output_tokens"] == len(result.token_ids) == 40
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    stats = result.stats
    assert attrs["specmesh.request.steps"] == stats.num_steps and attrs["specmesh.request.tau"] == stats.tau
    assert attrs["specmesh.request.acceptance_per_position"] == tuple(stats.acceptance_per_position())
    assert attrs["specmesh.request.per_source.draft_model.accepted"] == stats.per_source()["draft_model"]["accepted"]

    (prefill,) = by_name[PREFILL_SPAN]
    assert prefill.parent.span_id == req.context.span_id
    assert prefill.attributes["specmesh.prefill.prompt_tokens"] == len(prompt)

    steps = sorted(by_name[STEP_SPAN], key=lambda s: s.attributes["specmesh.step.index"])
    assert [s.attributes["specmesh.step.index"] for s in steps] == list(range(stats.num_steps))
    assert stats.num_steps > 3 and sum(s.num_accepted for s in stats.steps) > 0
    for span, step in zip(steps, stats.steps, strict=True):
        assert span.parent.span_id == req.context.span_id and span.context.trace_id == req.context.trace_id
        want = _attributes(step_attributes(step))
        assert {k: v for k, v in _attributes(span.attributes).items() if k in want} == want
        assert span.attributes["specmesh.step.drafter"] == "draft_model"
        depth, accepted = step.tree_depth, step.num_accepted
        assert span.attributes["specmesh.step.accepted_per_position"] == (1,) * accepted + (0,) * (depth - accepted)
    # each step span ended before the next began: none is held across the engine's yield
    assert all(a.end_time <= b.start_time for a, b in zip(steps, steps[1:], strict=False))
    assert prefill.end_time <= steps[0].start_time

    # drafter calls ran inside the step that asked for them (copied into the worker thread when overlapped)
    step_ids = {s.context.span_id for s in steps}
    asked = [(span_id, thread) for span_id, thread in recorder.calls if span_id in step_ids]
    assert len(asked) >= stats.num_steps - 1
    assert {span_id for span_id, _ in recorder.calls} <= step_ids | {req.context.span_id}  # + the close-time sync
    if overlap:
        assert all(thread.startswith("draft-worker") for _, thread in asked)  # the shared pool's threads


def test_core_requests_trace_each_step_under_their_own_span(memory_spans, model_sets):
    """On the engine core no thread runs a request: the request span is started (not made current) and every step
    the core runs for it becomes its child, with the step's attributes; concurrent requests do not mix."""
    from drafter_service.drafter import LocalDrafter
    from orchestrator.core import EngineCore
    from orchestrator.drafter_link import only
    from orchestrator.policy import StaticPolicy
    from orchestrator.requests import Method, QueueOutput
    from verifier_service.verifier import LocalVerifier

    ms = model_sets("cyclic")
    core = EngineCore(LocalVerifier(ms.runner("target", "fast")))
    prompts = make_prompts(3, seed=9)
    try:
        runs = []
        for i, prompt in enumerate(prompts):
            span = tracing.start_request_span("text_completion", f"tiny-{i}", greedy(24), len(prompt))
            output = QueueOutput()
            method = Method(only(LocalDrafter(make_proposer("prompt_lookup_tree")), "prompt_lookup_tree"),
                            StaticPolicy(8, 4))
            core.submit(prompt, greedy(24), method, output, trace=span)
            runs.append((span, output))
        for span, output in runs:
            list(output.events())
            span.end()
    finally:
        core.close()
    finished = memory_spans.get_finished_spans()
    for i, (_, output) in enumerate(runs):
        (req,) = [s for s in finished if s.name == f"text_completion tiny-{i}"]
        steps = sorted((s for s in finished if s.name == STEP_SPAN and s.parent.span_id == req.context.span_id),
                       key=lambda s: s.attributes["specmesh.step.index"])
        stats = output.result.stats
        assert [s.attributes["specmesh.step.index"] for s in steps] == list(range(stats.num_steps))
        for span, step in zip(steps, stats.steps, strict=True):
            want = _attributes(step_attributes(step))
            assert {k: v for k, v in _attributes(span.attributes).items() if k in want} == want
            assert span.context.trace_id == req.context.trace_id and span.start_time <= span.end_time
    assert sum(1 for s in finished if s.name == STEP_SPAN) == sum(o.result.stats.num_steps for _, o in runs)


def test_a_failing_step_records_its_error(memory_spans, model_sets):
    """An exception inside a step (the verifier failing) ends its span with the error, and the request's."""
    ms = model_sets("cyclic")
    engine = engine_for(ms.runner("target", "fast"), "prompt_lookup")
    calls = {"n": 0}
    verify = engine.verifier.verify

    def failing(session, tree):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("verifier gone")
        return verify(session, tree)

    engine.verifier.verify = failing
    sampling = greedy(20)
    with pytest.raises(RuntimeError), tracing.request_span("chat", "m", sampling, 5):
        engine.generate(make_prompts(1, seed=3)[0], sampling)
    steps = [s for s in memory_spans.get_finished_spans() if s.name == STEP_SPAN]
    assert len(steps) == 3
    assert [s.status.status_code for s in steps] == [trace.StatusCode.UNSET] * 2 + [trace.StatusCode.ERROR]
    assert steps[-1].events[0].name == "exception"
    (req,) = [s for s in memory_spans.get_finished_spans() if s.name == "chat m"]
    assert req.status.status_code == trace.StatusCode.ERROR


# ------------------------------------------------------------------ three processes, one trace per request
TOKEN = "client-token-for-the-traced-mesh"
INTERNAL = "internal-token-of-the-traced-mesh"
SERVE, VERIFIER, DRAFTER = "specmesh-serve", "specmesh-verifier", "specmesh-drafter"
PROMPTS = [  # (text, max_new_tokens, request options): both loops, two proposers
    ("def fibonacci(n):", 32, {"proposer": "draft_model"}),
    ("import os\nimport sys\n\n\ndef main(argv):\n    ", 24, {"proposer": "draft_model_tree", "overlap": False}),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n", 28, {"proposer": "prompt_lookup"}),
]


@pytest.fixture(scope="module")
def traced_mesh():
    """verifier + drafter + serve exporting spans to a receiver in this process; bearer tokens on every port."""
    receiver = OtlpReceiver()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "50"}
    services = []
    try:
        v = sh.verifier(env={**otel, "SPECMESH_TOKEN": INTERNAL})
        d = sh.drafter(env={**otel, "SPECMESH_TOKEN": INTERNAL})
        services += [v, d]
        sh.start_all(v, d)
        s = sh.serve([v], [d], env={**otel, "SPECMESH_TOKEN": TOKEN, "SPECMESH_UPSTREAM_TOKEN": INTERNAL})
        services.append(s)
        s.wait_ready()
        yield {"receiver": receiver, "verifier": v, "drafter": d, "serve": s}
    finally:
        for svc in services:
            svc.stop()
        receiver.stop()


@pytest.fixture(scope="module")
def traced_requests(traced_mesh):
    """The PROMPTS through the client SDK (token-id prompts of distinct lengths: the prefill span's prompt
    length finds each request's trace): [(prompt ids, client steps, output tokens, finish reason)]."""
    tokenizer = load_text_tokenizer(sh.TARGET)
    done = []
    with Client(traced_mesh["serve"].address, token=TOKEN, timeout=120) as client:
        assert client.health() == "SERVING"  # not traced
        for text, max_new, options in PROMPTS:
            ids = list(tokenizer.encode(text))
            chunks = list(client.stream(ids, max_new_tokens=max_new, **options))
            steps = [c.step for c in chunks if c.step is not None]
            done.append((ids, steps, sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason))
    assert len({len(ids) for ids, *_ in done}) == len(done)
    return done


def _traces(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.trace_id, []).append(s)
    return out


def _request_trace(spans, prompt_len: int) -> list:
    traces = _traces(spans)
    for s in spans:
        if s.service == SERVE and s.name == PREFILL_SPAN and s.attributes.get("specmesh.prefill.prompt_tokens") == prompt_len:
            return traces[s.trace_id]
    return []


def _complete(spans, prompt_len: int, num_steps: int) -> bool:
    """Every span of the request has arrived: its steps, the verifier's calls, the drafter's stream."""
    t = _request_trace(spans, prompt_len)
    names = [(s.service, s.name) for s in t]
    return (names.count((SERVE, STEP_SPAN)) >= num_steps
            and names.count((VERIFIER, VERIFY_ITEM_SPAN)) >= num_steps
            and (VERIFIER, "/specmesh.v1.Verifier/Release") in names
            and (DRAFTER, "/specmesh.v1.Drafter/Session") in names
            and any(s.service == SERVE and "gen_ai.operation.name" in s.attributes for s in t))


def _wait_for_spans(receiver, traced_requests) -> list:
    sh.wait_until(lambda: all(_complete(receiver.spans(), len(ids), len(steps))
                              for ids, steps, *_ in traced_requests), timeout=30, interval=0.1)
    time.sleep(0.3)  # anything still in flight (the drafter's stream span ends after serve's request)
    return receiver.spans()


def test_one_connected_trace_per_request(traced_mesh, traced_requests):
    spans = _wait_for_spans(traced_mesh["receiver"], traced_requests)
    assert not [s for s in spans if s.name.startswith(("/grpc.health", "/grpc.reflection"))]  # probes untraced
    request_traces = set()
    for ids, steps, num_output, finish in traced_requests:
        t = _request_trace(spans, len(ids))
        assert t, f"no prefill span for the {len(ids)}-token prompt"
        request_traces.add(t[0].trace_id)
        _check_request_trace(t, ids, steps, num_output, finish)
    # one trace per request: every request-serving span of the three services is in one of them
    assert len(request_traces) == len(traced_requests)
    for s in spans:
        if s.name in (STEP_SPAN, PREFILL_SPAN, "draft", VERIFY_ITEM_SPAN, "/specmesh.v1.Verifier/Prefill"):
            assert s.trace_id in request_traces, f"{s.service} {s.name} outside the requests' traces"
    assert any(step.predrafted for _, steps, *_ in traced_requests for step in steps)  # the PEARL loop ran


def _server_spans(t: list, service: str, method: str) -> list:
    return [s for s in t if s.service == service and s.name == method and s.kind == "SERVER"]


def _grandparent(by_id: dict, span):
    """The span in serve that made the call ``span`` serves (the parent of serve's client span)."""
    client = by_id[span.parent_id]
    assert client.service == SERVE and client.kind == "CLIENT" and client.name == span.name
    return by_id[client.parent_id]


def _check_request_trace(t: list, ids: list[int], steps: list, num_output: int, finish: str) -> None:
    by_id = {s.span_id: s for s in t}
    roots = [s for s in t if not s.parent_id]
    # connected: one root, every parent within the trace
    assert all(s.parent_id in by_id for s in t if s.parent_id), "a span's parent is outside the trace"
    assert [(r.service, r.name, r.kind) for r in roots] == [(SERVE, "/specmesh.v1.Generate/GenerateStream", "SERVER")]

    # serve: the request span (GenAI conventions) under the RPC's span, prefill and steps under it
    (req,) = [s for s in t if "gen_ai.operation.name" in s.attributes]
    assert req.service == SERVE and req.parent_id == roots[0].span_id
    model = req.attributes["gen_ai.request.model"]
    assert req.name == f"{req.attributes['gen_ai.operation.name']} {model}" and model
    assert req.attributes["gen_ai.provider.name"] == "specmesh"
    assert req.attributes["gen_ai.usage.input_tokens"] == len(ids)
    assert req.attributes["gen_ai.usage.output_tokens"] == num_output
    assert req.attributes["gen_ai.response.finish_reasons"] == (finish,)
    assert req.attributes["specmesh.request.steps"] == len(steps)
    (prefill,) = [s for s in t if s.name == PREFILL_SPAN]
    assert prefill.parent_id == req.span_id
    step_spans = sorted((s for s in t if s.name == STEP_SPAN), key=lambda s: s.attributes["specmesh.step.index"])
    assert len(step_spans) == len(steps)
    for span, step in zip(step_spans, steps, strict=True):
        assert span.service == SERVE and span.parent_id == req.span_id
        _check_step_attributes(span.attributes, step)

    # the verifier: Prefill under serve's prefill; each step's item of the replica's VerifyBatch under that step
    # (the call serves many requests: untraced itself, its items carry their steps' context)
    (v_prefill,) = _server_spans(t, VERIFIER, "/specmesh.v1.Verifier/Prefill")
    assert _grandparent(by_id, v_prefill) is prefill
    assert v_prefill.attributes["specmesh.prefill.prompt_tokens"] == len(ids)
    verifies = _server_spans(t, VERIFIER, VERIFY_ITEM_SPAN)
    assert sorted(v.parent_id for v in verifies) == sorted(s.span_id for s in step_spans)
    for v in verifies:
        assert v.attributes["specmesh.session.id"] == prefill.attributes["specmesh.session.id"]
        step = steps[by_id[v.parent_id].attributes["specmesh.step.index"]]
        assert v.attributes["specmesh.verify.tree_nodes"] == step.num_proposed
        assert v.attributes["specmesh.verify.accepted"] == step.num_accepted
        assert v.attributes["specmesh.verify.batch_sessions"] >= 1
    (release,) = _server_spans(t, VERIFIER, "/specmesh.v1.Verifier/Release")
    assert _grandparent(by_id, release) is req

    # the drafter: its session stream under the request, a span per proposal under the stream
    (session,) = _server_spans(t, DRAFTER, "/specmesh.v1.Drafter/Session")
    assert _grandparent(by_id, session) is req
    assert session.attributes["specmesh.session.id"] == prefill.attributes["specmesh.session.id"]
    drafts = [s for s in t if s.service == DRAFTER and s.name == "draft"]
    assert len(drafts) >= sum(1 for s in steps if s.num_proposed) - sum(1 for s in steps if s.predrafted)
    assert all(s.parent_id == session.span_id for s in drafts)
    assert all(s.attributes["specmesh.draft.nodes"] <= s.attributes["specmesh.draft.budget_nodes"] for s in drafts)
    assert [s.name for s in t if s.service == DRAFTER and s.parent_id == session.span_id].count("draft_open") == 1


def _check_step_attributes(attrs: dict, step) -> None:
    """A step span's attributes equal what the client got for that step (StepInfo)."""
    assert attrs["specmesh.step.proposed"] == step.num_proposed
    assert attrs["specmesh.step.tree_depth"] == step.tree_depth
    assert attrs["specmesh.step.accepted"] == step.num_accepted
    assert attrs["specmesh.step.accepted_per_position"] == (1,) * step.num_accepted + (0,) * (
        step.tree_depth - step.num_accepted)
    assert attrs.get("specmesh.step.accepted_sources", ()) == step.accepted_sources
    assert tuple(zip(attrs.get("specmesh.step.proposed_sources", ()), attrs.get("specmesh.step.proposed_per_source", ()),
                     strict=True)) == step.proposed_per_source
    assert (attrs["specmesh.step.budget_nodes"], attrs["specmesh.step.budget_depth"]) == step.budget
    assert attrs["specmesh.step.predrafted"] == step.predrafted
    assert attrs["specmesh.step.predraft_nodes"] == step.predraft_nodes
    assert attrs["specmesh.step.predraft_used"] == step.predraft_used
    assert attrs.get("specmesh.step.draft_error", "") == step.draft_error
    for name, value in [("wait_ms", step.wait_ms), ("verify_ms", step.verify_ms), ("draft_ms", step.draft_ms)]:
        assert attrs[f"specmesh.step.{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert attrs["specmesh.step.drafter"].startswith("drafter 127.0.0.1:")


def test_our_interceptors_still_guard_a_traced_server(traced_mesh, traced_requests):
    """With tracing on: a call without the token is refused before it is traced; an undecodable one is
    INVALID_ARGUMENT, which its span records."""
    verifier = traced_mesh["verifier"]
    ch = sh.channel(verifier)
    stub = verifier_pb2_grpc.VerifierStub(ch)
    with pytest.raises(grpc.RpcError) as err:
        stub.Info(verifier_pb2.InfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    internal = (("authorization", f"Bearer {INTERNAL}"),)
    with pytest.raises(grpc.RpcError) as err:
        ch.unary_unary("/specmesh.v1.Verifier/Prefill")(b"\xff\xff\xff\xff", timeout=10, metadata=internal)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in err.value.details()
    assert stub.Info(verifier_pb2.InfoRequest(), timeout=10, metadata=internal).vocab_size > 0
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    receiver = traced_mesh["receiver"]

    def roots(method):  # calls from this test carry no trace context: their server spans are roots
        return [s for s in receiver.spans() if s.service == VERIFIER and s.name == method and not s.parent_id]

    assert sh.wait_until(lambda: roots("/specmesh.v1.Verifier/Info") and roots("/specmesh.v1.Verifier/Prefill"),
                         timeout=15)
    time.sleep(0.3)
    assert len(roots("/specmesh.v1.Verifier/Info")) == 1  # the authorised call only
    (bad,) = roots("/specmesh.v1.Verifier/Prefill")
    # the caller's error: a server span records its code without an error status (RPC semantic conventions)
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not [s for s in receiver.spans() if s.name.startswith("/grpc.health")]


# ------------------------------------------------------------------ probes and scrapes are not requests
PROBE_PATHS = ("/metrics", "/health", "/readyz", "/livez", "/load")


def _scope(path: str, root_path: str = "") -> dict:
    return {"type": "http", "scheme": "http", "server": ("127.0.0.1", 8000), "path": root_path + path,
            "root_path": root_path, "query_string": b""}


@pytest.fixture
def trace_probes():
    """setup_tracing's trace_probes for the test (no OTEL_* variable: it installs nothing), put back after."""
    def set_to(value: bool) -> None:
        assert tracing.setup_tracing("specmesh-test", trace_probes=value) is False

    yield set_to
    set_to(False)


@pytest.mark.parametrize("env,probes,excluded,traced", [
    ({}, False, [*PROBE_PATHS, "/metrics|/api"], ["/v1/completions", "/v1/chat/completions", "/v1/models",
                                                       "/version", "/metrics/x", "/healthz"]),
    ({}, True, [], ["/metrics", "/health", "/v1/completions"]),
    # OpenTelemetry's variables replace the default: regular expressions searched for in the URL
    ({"OTEL_PYTHON_EXCLUDED_URLS": "metrics,/v1/models$"}, False, ["/metrics", "/x/metrics/y", "/v1/models"],
     ["/health", "/livez", "/v1/models/m", "/v1/completions"]),
    ({"OTEL_PYTHON_EXCLUDED_URLS": "health", "OTEL_PYTHON_FASTAPI_EXCLUDED_URLS": "^http://127.0.0.1:8000/load$"},
     True, ["/load"], ["/health", "/metrics"]),
    ({"OTEL_PYTHON_EXCLUDED_URLS": ""}, False, [], [*PROBE_PATHS, "/v1/completions"]),  # set empty: trace all
])
def test_http_probes_are_excluded_as_opentelemetry_does(trace_probes, env, probes, excluded, traced):
    trace_probes(probes)
    exclude = tracing.http_excluded(env)
    if not excluded:
        assert exclude is None
        return
    for path in excluded:
        path, _, root = path.partition("|")  # path|root_path: a mounted app's probe
        assert exclude(_scope(path, root)), path
    for path in traced:
        assert not exclude(_scope(path)), path


def test_grpc_health_checks_are_traced_only_when_asked(trace_probes):
    check = types.SimpleNamespace(method="/grpc.health.v1.Health/Check")
    reflection = types.SimpleNamespace(full_method="/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    call = types.SimpleNamespace(method=b"/specmesh.v1.Generate/Generate")
    assert [tracing._traced_call(d) for d in (check, reflection, call)] == [False, False, True]
    trace_probes(True)
    assert [tracing._traced_call(d) for d in (check, reflection, call)] == [True, False, True]


def _settled(receiver, quiet: float = 0.3) -> bool:
    num_spans = len(receiver.spans())
    time.sleep(quiet)
    return len(receiver.spans()) == num_spans


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as response:
        response.read()
        return response.status


@pytest.mark.parametrize("probes", [False, True], ids=["default", "trace-probes"])
def test_probes_and_scrapes_make_no_trace(probes):
    """A real `serve --embedded` exporting to an OTLP receiver: 50 rounds of Prometheus scrapes, HTTP probes and
    gRPC health checks make no span, and each completion (one over HTTP, one over gRPC) is exactly one trace, its
    request span under the HTTP / gRPC server span; with --trace-probes every probe is a trace of its own."""
    receiver = OtlpReceiver()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "50"}
    proc = sh.Service(["-m", "specmesh", "serve", "--embedded", "--target", sh.TARGET, "--draft", sh.DRAFT,
                       "--dtype", "float64", "--threads", "1", "--http", f"127.0.0.1:{port}", "--model-name", "m",
                       *(["--trace-probes"] if probes else [])], env=otel, name="serve --embedded")
    url = f"http://127.0.0.1:{port}"
    rounds = 5 if probes else 50
    try:
        proc.wait_ready()
        assert sh.wait_until(lambda: _settled(receiver), timeout=15)  # the warm-up's traces (before the port opens)
        before = {s.trace_id for s in receiver.spans()}
        health = health_pb2_grpc.HealthStub(sh.channel(proc))
        for _ in range(rounds):
            assert [_get(url + path) for path in PROBE_PATHS] == [200] * len(PROBE_PATHS)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        body = json.dumps({"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 8
        with Client(proc.address, timeout=120) as client:
            assert len(client.generate("import os\n", max_new_tokens=8).token_ids) == 8

        def request_spans():  # (serve's warm-up makes some before)
            return [s for s in receiver.spans() if "gen_ai.operation.name" in s.attributes and s.trace_id not in before]

        assert sh.wait_until(lambda: len(request_spans()) == 2, timeout=30)
        time.sleep(0.5)  # the server spans end after their request spans
        traces = _traces([s for s in receiver.spans() if s.trace_id not in before])
    finally:
        proc.stop()
        receiver.stop()
    request_ids = {s.trace_id for s in request_spans()}
    assert len(request_ids) == 2  # one trace per completion
    roots = {}
    for trace_id, spans in traces.items():
        (root,) = [s for s in spans if not s.parent_id]
        assert all(s.parent_id in {x.span_id for x in spans} for s in spans if s.parent_id)  # connected
        roots.setdefault(root.name, []).append(trace_id)
    assert set(roots.pop("POST /v1/completions")) | set(roots.pop("/specmesh.v1.Generate/Generate")) == request_ids
    expected = {f"GET {path}": rounds for path in PROBE_PATHS} | {"/grpc.health.v1.Health/Check": rounds}
    assert {name: len(ids) for name, ids in roots.items()} == (expected if probes else {})
