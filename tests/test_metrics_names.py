"""Metric names as a Prometheus server stores them (issue 35, items 1 and 2).

- Each process's registry (serve, verifier, drafter; Ray Serve's Membership with the autoscale gauges), after some
  activity, exposes the same series in the text
  0.0.4 format and in OpenMetrics (what a Prometheus server negotiates), with HELP/TYPE for exactly those, no
  colon and no ``_created`` series; together they are the metric tables of docs/observability.md.
- Labelled children exist at 0 before their first event; every verifier and drafter sample has ``model_name``.
- A real Prometheus (Debian's `prometheus`, skipped where absent) scraping the HTTP API's /metrics, the
  ``--metrics`` ports and a text-only endpoint stores the documented names, the same from every endpoint, with
  metadata only for families that have samples.
"""

from __future__ import annotations

import http.server
import re
import threading
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_server import prometheus_server
from spec_helpers import greedy, make_prompts

from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import proposer_names
from orchestrator import http_api
from orchestrator.metrics import FINISHED_REASONS, ServeMetrics, default_positions
from orchestrator.stats import StepStats
from specmesh.metrics import exposition, start_metrics_server
from specmesh.tree import TokenTree
from specmesh_app.fleet_metrics import AutoscaleMetrics, PoolView
from verifier_service.metrics import VerifierMetrics
from verifier_service.step_loop import StepLoop
from verifier_service.verifier import LocalVerifier

MODEL = "m"
OBSERVABILITY = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
ROW = re.compile(r"^\| (`specmesh_.+?`) \| (counter|gauge|histogram) \|", re.M)
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
# what a Prometheus 2.x server sends
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def documented() -> dict[str, str]:
    """family -> type, from the metric tables of docs/observability.md."""
    families = {}
    for names, kind in ROW.findall(OBSERVABILITY.read_text()):
        for name in re.findall(r"`(specmesh_\w+)`", names):
            families[name] = kind
    return families


def series_names(families: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in families.items() for suffix in SUFFIXES[kind]}


def families_of(text: str, parse) -> dict[str, str]:
    return {f.name: f.type for f in parse(text)}


def samples_of(text: str, parse) -> set[str]:
    return {s.name for f in parse(text) for s in f.samples}


def typed_names(text: str) -> dict[str, str]:
    """The exposition's ``# TYPE`` lines: name -> type (what Prometheus keeps as metadata)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def has_samples(name: str, kind: str, samples: set[str]) -> bool:
    """A TYPE line's name has samples: the family's own (text: ``x_total`` for a counter; OpenMetrics: ``x``)."""
    return any(name + suffix in samples for suffix in ("", *SUFFIXES.get(kind, ())))


# ------------------------------------------------------------------ registries after some activity
@pytest.fixture(scope="module")
def runner(model_sets):
    return model_sets("cyclic").runner("target", "fast")


def serve_metrics() -> ServeMetrics:
    metrics = ServeMetrics(MODEL)
    request = metrics.request()
    request.started()
    request.emitted(1)
    request.step(StepStats(3, 2, 1, ("copy",), ("copy", "copy", "retrieval"), 0.0, 0.01))
    request.emitted(2)
    request.finished("length", 5, 3)
    return metrics


def drafter_metrics() -> DrafterMetrics:
    metrics = DrafterMetrics(sessions=lambda: {"copy": 1, "prompt_lookup": 0}, model_name=MODEL,
                             proposers=("copy", "prompt_lookup"))
    metrics.proposed("copy", 4, 0.002, num_feedback=1)
    metrics.proposed("copy", 0, 0.0, drafted=False)
    return metrics


def autoscale_metrics() -> AutoscaleMetrics:
    """Membership's gauges over a verifier and a drafter pool, as a Ray Serve application has them."""
    view = PoolView(MODEL, {"Verifier": {"sessions": 3.0, "kv_usage": 0.25}, "Drafter": {"draft_busy": 0.5}},
                    {"Verifier": (2, 1), "Drafter": (1, 1), "Orchestrator": (1, 1)})
    return AutoscaleMetrics(lambda: view)


@pytest.fixture(scope="module")
def registries(runner):
    """process -> registry, after a request, a Verify and a few Proposes."""
    loop = StepLoop(LocalVerifier(runner, max_tree_nodes=8, prefill_chunk=16))
    try:
        loop.prefill("a", make_prompts(1, seed=2, min_len=20, max_len=20)[0], greedy(4))
        loop.verify("a", TokenTree.empty())
        yield {"serve": serve_metrics().registry, "drafter": drafter_metrics().registry,
               "verifier": VerifierMetrics(lambda: [loop], model_name=MODEL).registry,
               "membership": autoscale_metrics().registry}
    finally:
        loop.close()


# ------------------------------------------------------------------ both formats
@pytest.mark.parametrize("process", ["serve", "verifier", "drafter", "membership"])
def test_text_and_openmetrics_expose_the_same_series(registries, process):
    registry = registries[process]
    text, openmetrics = generate_latest(registry).decode(), generate_openmetrics(registry).decode()
    names = samples_of(text, parse_text)
    assert names == samples_of(openmetrics, parse_openmetrics)
    assert families_of(text, parse_text) == families_of(openmetrics, parse_openmetrics)
    assert all(name.startswith("specmesh_") and ":" not in name for name in names), names
    assert not [name for name in names if name.endswith("_created")]
    for exposed in (text, openmetrics):  # metadata for exactly the families that have samples
        typed = typed_names(exposed)
        assert all(has_samples(name, kind, names) for name, kind in typed.items()), typed


def test_the_observability_page_documents_every_series(registries):
    families = {}
    for registry in registries.values():
        families |= families_of(generate_openmetrics(registry).decode(), parse_openmetrics)
    assert families == documented()


def test_the_http_format_follows_the_accept_header(registries):
    registry = registries["serve"]
    body, content_type = exposition(registry, PROMETHEUS_ACCEPT)
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    body, content_type = exposition(registry, None)
    assert content_type.startswith("text/plain; version=0.0.4") and body == generate_latest(registry)


# ------------------------------------------------------------------ series from the start
def test_labelled_children_exist_at_zero_in_a_fresh_registry():
    serve = ServeMetrics(MODEL).registry

    def zero(registry, name: str, **labels) -> bool:
        return registry.get_sample_value(name, {"model_name": MODEL, **labels}) == 0

    assert all(zero(serve, "specmesh_request_success_total", finished_reason=r) for r in FINISHED_REASONS)
    assert default_positions() > 0
    assert all(zero(serve, "specmesh_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(default_positions()))
    for name in ("draft_tokens", "accepted_tokens"):
        assert all(zero(serve, f"specmesh_spec_decode_num_{name}_per_source_total", source=s) for s in proposer_names())
    drafter = DrafterMetrics(model_name=MODEL, proposers=("copy", "retrieval")).registry
    for proposer in ("copy", "retrieval"):
        for name in ("proposals_total", "proposal_seconds_count", "proposed_nodes_total", "tree_nodes_count",
                     "context_syncs_total", "feedback_items_total"):
            assert zero(drafter, "specmesh_drafter_" + name, proposer=proposer), (name, proposer)
    # the embedded stack makes its verifiers lazily: every series is there before the first one
    verifier = VerifierMetrics(list, model_name=MODEL).registry
    names = samples_of(generate_latest(verifier).decode(), parse_text)
    assert names == series_names({n: k for n, k in documented().items() if n.startswith(
        ("specmesh_verifier_", "specmesh_kv_cache", "specmesh_num_preemptions", "specmesh_prefix_cache"))})


def test_every_sample_carries_model_name(registries):
    for process, registry in registries.items():
        for family in registry.collect():
            assert family.samples, family.name
            assert all(s.labels.get("model_name") == MODEL for s in family.samples), (process, family.name)


# ------------------------------------------------------------------ a real Prometheus
class _TextOnly(http.server.BaseHTTPRequestHandler):
    """/metrics in the text 0.0.4 format whatever the scraper asks for (an older client library's answer)."""

    registry = None

    def do_GET(self) -> None:
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def text_only_server(registry) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (_TextOnly,), {"registry": registry})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_real_prometheus_stores_the_documented_names(tmp_path):
    from tests import test_http_api as http_tests

    served = http_tests.MODEL
    stacks = http_tests.http_stack()
    stack = next(stacks)
    service = http_tests.make_service(stack)
    service.backend.register_metrics(service.metrics.registry, served)  # as `serve` does
    app = http_tests.AppThread(http_api.build_app(service, None))
    text_only = text_only_server(service.metrics.registry)
    try:
        status, _ = http_tests.post(app.url + "/v1/completions", {"model": served, "prompt": http_tests.PROMPTS[0],
                                                                  "max_tokens": 8, "temperature": 0})
        assert status == 200
        verifier = VerifierMetrics(lambda: [core.scheduler for core in stack.shared_verifiers()], model_name=served)
        drafter = drafter_metrics()
        membership = autoscale_metrics()
        jobs = {"http_api": [f"127.0.0.1:{app.port}"],
                "serve": [f"127.0.0.1:{start_metrics_server('127.0.0.1:0', service.metrics.registry)}"],
                "serve_text": [f"127.0.0.1:{text_only.server_address[1]}"],
                "verifier": [f"127.0.0.1:{start_metrics_server('127.0.0.1:0', verifier.registry)}"],
                "drafter": [f"127.0.0.1:{start_metrics_server('127.0.0.1:0', drafter.registry)}"],
                "membership": [f"127.0.0.1:{start_metrics_server('127.0.0.1:0', membership.registry)}"]}
        expected = series_names(documented())
        with prometheus_server(tmp_path, jobs) as prometheus:
            def scraped() -> bool:
                up = prometheus.query("up")
                return len(up) == len(jobs) and all(r["value"][1] == "1" for r in up) and expected <= prometheus.names()

            assert prometheus.wait_for(scraped), (prometheus.query("up"), expected - prometheus.names())
            stored = {name for name in prometheus.names() if name.startswith("specmesh")}
            assert stored == expected  # no colon, no _created, nothing undocumented

            def names_of(job: str) -> set[str]:
                return {r["metric"]["__name__"] for r in prometheus.query(f'{{job="{job}",__name__=~"specmesh_.+"}}')}

            # one counter, one name: the HTTP API, the --metrics port (OpenMetrics) and the text format agree
            assert names_of("http_api") == names_of("serve") == names_of("serve_text")
            assert names_of("drafter") | names_of("serve") | names_of("membership") == expected
            assert not prometheus.query('{__name__=~"specmesh_.+",model_name=""}')  # every series has a model
            reasons = prometheus.query('specmesh_request_success_total{job="http_api"}')
            assert {r["metric"]["finished_reason"] for r in reasons} == set(FINISHED_REASONS)  # before any error
            assert float(prometheus.query('specmesh_request_success_total{job="http_api",finished_reason="length"}')
                         [0]["value"][1]) == 1
            metadata = prometheus.api("metadata")
            specmesh = {name: entries[0]["type"] for name, entries in metadata.items() if name.startswith("specmesh")}
            for name, kind in documented().items():
                assert specmesh.get(name) == kind, (name, specmesh.get(name))
            assert all(has_samples(name, kind, stored) for name, kind in specmesh.items()), specmesh
    finally:
        text_only.shutdown()
        app.stop()
        next(stacks, None)  # closes the stack
