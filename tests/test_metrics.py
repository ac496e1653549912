"""Prometheus metrics: the counts a scrape shows equal the sums over what the requests did.

- ``ServeMetrics``/``RequestMetrics`` driven by synthetic StepStats and a fake clock: speculation
  counters = sums over the steps, latencies from the clock, gauges follow waiting -> running -> done.
- ``VerifierMetrics`` over real StepLoops on a tiny model (engines on threads share one):
  Verify calls = the requests' steps, prefill tokens = their prompts, histograms agree with the counters.
- ``DrafterMetrics`` by proposer, ``--metrics`` parsing and the HTTP endpoint (port 0, port in use), and its
  security: HTTPS, client certificates and the bearer token as the API port has them.
"""

from __future__ import annotations

import argparse
import random
import ssl
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from spec_helpers import engine_for, greedy, make_prompts
from tls_helpers import make_pki

from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import proposer_names
from orchestrator.metrics import ServeMetrics
from orchestrator.stats import RequestStats, StepStats
from specmesh.metrics import (
    Buckets,
    MetricsAccess,
    Registry,
    add_metrics_argument,
    histogram_family,
    start_metrics_server,
)
from specmesh.tree import TokenTree
from verifier_service.metrics import VerifierMetrics
from verifier_service.step_loop import StepLoop
from verifier_service.verifier import LocalVerifier

MODEL = "m"


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    """A sample's value (0 when absent); every family has ``model_name``, MODEL unless given."""
    labels.setdefault("model_name", MODEL)
    got = registry.get_sample_value("specmesh_" + name, labels)
    return 0.0 if got is None else got


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def random_steps(rng: random.Random, num: int) -> list[StepStats]:
    steps = []
    for _ in range(num):
        proposed = rng.choice([0, 0, 1, 3, 6, 12])
        depth = min(proposed, rng.randint(1, 5)) if proposed else 0
        accepted = rng.randint(0, depth)
        sources = tuple(rng.choice(["copy", "retrieval", "draft_model"]) for _ in range(proposed))
        steps.append(StepStats(
            num_proposed=proposed, tree_depth=depth, num_accepted=accepted, accepted_sources=sources[:accepted],
            proposed_sources=sources, draft_seconds=0.0, verify_seconds=0.01,
            draft_error="copy: TimeoutError: late" if rng.random() < 0.15 else "",
        ))
    return steps


# ------------------------------------------------------------------ serve
def test_spec_decode_counters_are_sums_over_the_steps():
    metrics = ServeMetrics(MODEL)
    r = metrics.registry
    rng = random.Random(3)
    requests = [random_steps(rng, n) for n in (40, 25, 60)]
    for steps in requests:
        req = metrics.request()
        req.started()
        for step in steps:
            req.step(step)
        req.finished("length", 10, sum(s.num_accepted + 1 for s in steps))
    steps = [s for steps in requests for s in steps]
    assert value(r, "spec_decode_num_drafts_total", model_name=MODEL) == sum(s.num_proposed > 0 for s in steps)
    assert value(r, "spec_decode_num_draft_tokens_total", model_name=MODEL) == sum(s.num_proposed for s in steps)
    assert value(r, "spec_decode_num_accepted_tokens_total", model_name=MODEL) == sum(s.num_accepted for s in steps)
    depth = max(s.num_accepted for s in steps)
    assert depth > 2
    for d in range(depth + 2):
        assert value(r, "spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position=str(d)) == sum(
            s.num_accepted > d for s in steps)
    for source in ("copy", "retrieval", "draft_model"):
        assert value(r, "spec_decode_num_draft_tokens_per_source_total", model_name=MODEL, source=source) == sum(
            s.proposed_sources.count(source) for s in steps)
        assert value(r, "spec_decode_num_accepted_tokens_per_source_total", model_name=MODEL, source=source) == sum(
            s.accepted_sources.count(source) for s in steps)
    failovers = sum(bool(s.draft_error) for s in steps)
    assert failovers > 0
    assert value(r, "spec_decode_num_drafter_failovers_total", model_name=MODEL) == failovers
    assert value(r, "spec_decode_tokens_per_step_count", model_name=MODEL) == len(steps)
    assert value(r, "spec_decode_tokens_per_step_sum", model_name=MODEL) == sum(s.num_accepted + 1 for s in steps)
    assert value(r, "request_success_total", model_name=MODEL, finished_reason="length") == 3
    assert value(r, "prompt_tokens_total", model_name=MODEL) == 30
    assert value(r, "generation_tokens_total", model_name=MODEL) == sum(s.num_accepted + 1 for s in steps)
    text = generate_latest(r).decode()
    assert 'specmesh_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def test_per_request_acceptance_and_tau_histograms():
    metrics = ServeMetrics(MODEL)
    r = metrics.registry
    rng = random.Random(5)
    requests = [random_steps(rng, n) for n in (30, 12, 50)]
    plain = [StepStats(num_proposed=0, tree_depth=0, num_accepted=0, accepted_sources=(), proposed_sources=(),
                       draft_seconds=0.0, verify_seconds=0.01)] * 8
    for steps in [*requests, plain]:
        req = metrics.request()
        req.started()
        stats = RequestStats(steps=list(steps))
        req.finished("length", 10, sum(s.num_accepted + 1 for s in steps), stats)
    rates = [RequestStats(steps=steps).acceptance_rate for steps in requests]
    taus = [RequestStats(steps=steps).tau for steps in requests]
    assert 0 < min(rates) and max(rates) < 1
    # a plain request (nothing drafted) is not observed: it has no acceptance to report
    assert value(r, "request_acceptance_rate_count", model_name=MODEL) == len(requests)
    assert value(r, "request_acceptance_rate_sum", model_name=MODEL) == pytest.approx(sum(rates))
    assert value(r, "request_tau_count", model_name=MODEL) == len(requests)
    assert value(r, "request_tau_sum", model_name=MODEL) == pytest.approx(sum(taus))
    assert value(r, "request_acceptance_rate_bucket", model_name=MODEL, le="1.0") == len(requests)
    for steps, rate in zip(requests, rates, strict=True):
        assert rate == sum(s.num_accepted for s in steps) / sum(s.num_proposed for s in steps)


def test_source_labels_are_bounded():
    """Source names come from drafters: past MAX_SOURCES distinct names the rest count as 'other'."""
    from orchestrator.metrics import MAX_SOURCES

    metrics = ServeMetrics(MODEL)
    req = metrics.request()
    names = [f"p{i}" for i in range(MAX_SOURCES + 5)]
    req.step(StepStats(len(names), 1, 0, (), tuple(names), 0.0, 0.0))
    r = metrics.registry
    free = MAX_SOURCES - len(proposer_names())  # the registered proposers' labels exist from the start
    assert value(r, "spec_decode_num_draft_tokens_per_source_total", model_name=MODEL, source="p0") == 1
    assert value(r, "spec_decode_num_draft_tokens_per_source_total", model_name=MODEL, source="other") == len(
        names) - free
    labels = {s.labels["source"] for f in r.collect() for s in f.samples if "source" in s.labels}
    assert len(labels) == MAX_SOURCES + 1


def test_request_lifecycle_gauges_and_latencies():
    clock = FakeClock()
    metrics = ServeMetrics(MODEL, clock=clock)
    r = metrics.registry

    def gauges():
        return (value(r, "num_requests_waiting", model_name=MODEL), value(r, "num_requests_running", model_name=MODEL))

    a, b = metrics.request(), metrics.request()
    assert gauges() == (2, 0)
    a.started()
    a.started()  # once
    assert gauges() == (1, 1)
    clock.now += 0.5
    a.emitted(0)  # nothing went out
    a.emitted(1)  # the first token, 0.5 s after arrival
    clock.now += 0.3
    a.emitted(3)  # three tokens after 0.3 s: three samples of 0.1 s
    clock.now += 0.2
    a.emitted(2)
    assert value(r, "time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert value(r, "time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.5)
    assert value(r, "inter_token_latency_seconds_count", model_name=MODEL) == 5
    assert value(r, "inter_token_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.5)
    assert value(r, "inter_token_latency_seconds_bucket", model_name=MODEL, le="0.15") == 5
    assert value(r, "inter_token_latency_seconds_bucket", model_name=MODEL, le="0.075") == 0
    a.finished("stop", 7, 6)
    a.finished("error", 7, 6)  # idempotent: a `finally` may call it again
    assert gauges() == (1, 0)
    assert value(r, "e2e_request_latency_seconds_count", model_name=MODEL) == 1
    assert value(r, "e2e_request_latency_seconds_sum", model_name=MODEL) == pytest.approx(1.0)
    assert value(r, "request_success_total", model_name=MODEL, finished_reason="stop") == 1
    assert value(r, "request_success_total", model_name=MODEL, finished_reason="error") == 0
    b.finished("aborted", 4, 0)  # gave up while waiting: leaves the queue
    b.started()  # too late: nothing changes
    assert gauges() == (0, 0)
    assert value(r, "request_success_total", model_name=MODEL, finished_reason="aborted") == 1
    assert value(r, "prompt_tokens_total", model_name=MODEL) == 11
    assert value(r, "generation_tokens_total", model_name=MODEL) == 6


def test_concurrent_requests_keep_the_gauges_exact():
    metrics = ServeMetrics(MODEL)

    def one(i: int) -> None:
        req = metrics.request()
        if i % 3:
            req.started()
            req.emitted(1)
            req.emitted(2)
        threads = [threading.Thread(target=req.finished, args=("length", 1, 3)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    workers = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    r = metrics.registry
    assert value(r, "num_requests_waiting", model_name=MODEL) == 0
    assert value(r, "num_requests_running", model_name=MODEL) == 0
    assert value(r, "request_success_total", model_name=MODEL, finished_reason="length") == 24


def test_every_metrics_object_has_its_own_registry_and_they_can_share_one():
    assert ServeMetrics(MODEL).registry is not ServeMetrics(MODEL).registry  # no clash: no global registry
    shared = CollectorRegistry()  # the embedded server: orchestrator, verifiers and drafters in one process
    ServeMetrics(MODEL, shared)
    VerifierMetrics(list, shared, model_name=MODEL)
    DrafterMetrics(shared, dict, model_name=MODEL)
    with pytest.raises(ValueError, match="Duplicated"):
        VerifierMetrics(list, shared, model_name=MODEL)
    generate_latest(shared)


# ------------------------------------------------------------------ verifier
@pytest.fixture(scope="module")
def runner(model_sets):
    return model_sets("cyclic").runner("target", "fast")


def test_verifier_counts_equal_the_requests_steps(runner):
    prompts = make_prompts(6, seed=5, min_len=10, max_len=45)
    verifiers = [StepLoop(LocalVerifier(runner, max_tree_nodes=16, prefill_chunk=16)) for _ in range(2)]
    metrics = VerifierMetrics(lambda: verifiers, model_name=MODEL)
    r = metrics.registry
    results = [None] * len(prompts)

    def run(i: int) -> None:  # requests alternate between the two verifiers, several at once on each
        engine = engine_for(runner, "prompt_lookup", verifier=verifiers[i % 2])
        results[i] = engine.generate(prompts[i], greedy(16))

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        steps = [s for res in results for s in res.stats.steps]
        chunks = sum(-(-len(p) // 16) for p in prompts)
        assert value(r, "verifier_verify_calls_total") == len(steps)
        assert value(r, "verifier_verify_rows_total") == sum(s.num_proposed + 1 for s in steps)
        assert value(r, "verifier_prefill_calls_total") == len(prompts)
        assert value(r, "verifier_prefill_tokens_total") == sum(len(p) for p in prompts)
        assert value(r, "verifier_prefill_chunks_total") == chunks
        num_steps = value(r, "verifier_steps_total")
        assert num_steps == sum(v.stats.steps for v in verifiers) <= len(steps) + chunks
        for name in ("batch_sessions", "batch_rows", "step_seconds"):
            assert value(r, f"verifier_{name}_count") == num_steps
            assert value(r, f"verifier_{name}_bucket", le="+Inf") == num_steps
        assert value(r, "verifier_batch_sessions_sum") == len(steps) + chunks
        assert value(r, "verifier_batch_rows_sum") == (sum(s.num_proposed + 1 for s in steps)
                                                       + sum(len(p) for p in prompts))
        assert value(r, "verifier_step_seconds_sum") > 0
        assert value(r, "verifier_num_sessions") == 0 and value(r, "kv_cache_usage_perc") == 0  # all released
        assert value(r, "verifier_kv_blocks") == sum(v.verifier.allocator.num_blocks for v in verifiers)
    finally:
        for v in verifiers:
            v.close()


def test_verifier_gauges_follow_sessions_and_the_admission_queue(runner):
    prompt, other = make_prompts(2, seed=9, min_len=20, max_len=20)
    per_session = len(prompt) + 8 + 1 + 8  # a session's largest footprint: prompt + max_new + pending + largest tree
    local = LocalVerifier(runner, max_tree_nodes=8, kv_cache_gb=per_session * runner.kv_bytes_per_token / 2**30,
                          block_size=1)
    batching = StepLoop(local, max_waiting=4)
    r = VerifierMetrics(lambda: [batching], model_name=MODEL).registry
    try:
        batching.prefill("a", prompt, greedy(8))
        # admission took the prompt's blocks (blocks of one token)
        assert value(r, "verifier_num_sessions") == 1 and value(r, "verifier_kv_blocks_reserved") == len(prompt)
        assert value(r, "verifier_kv_blocks_used") == len(prompt)
        assert value(r, "kv_cache_usage_perc") == pytest.approx(len(prompt) / per_session)
        waiting = batching.submit_prefill("b", other, greedy(8))  # its prompt's blocks are not free: it waits
        assert value(r, "verifier_num_waiting") == 1 and value(r, "verifier_num_sessions") == 1
        batching.verify("a", TokenTree.empty())  # the pending token goes into the cache: a step takes its block
        assert value(r, "verifier_kv_blocks_used") == len(prompt) + 1 == value(r, "verifier_kv_blocks_reserved")
        assert value(r, "kv_cache_usage_perc") == pytest.approx((len(prompt) + 1) / per_session)
        batching.release("a")
        waiting.result(timeout=30)
        assert value(r, "verifier_num_waiting") == 0 and value(r, "verifier_num_sessions") == 1
        batching.release("b")
        assert value(r, "verifier_num_sessions") == 0 and value(r, "kv_cache_usage_perc") == 0.0
        assert value(r, "verifier_kv_blocks_used") == 0 == value(r, "verifier_kv_blocks_reserved")
        assert value(r, "verifier_kv_blocks") == per_session
        assert value(r, "verifier_verify_calls_total") == 1 and value(r, "verifier_prefill_calls_total") == 2
    finally:
        batching.close()


def test_histogram_family_sums_buckets():
    a, b = Buckets((1, 4)), Buckets((1, 4))
    for x in (1, 2, 5):
        a.observe(x)
    b.observe(0.5)
    family = histogram_family("specmesh_x", "x", [a, b])
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples["specmesh_x_bucket", "1.0"] == 2
    assert samples["specmesh_x_bucket", "4.0"] == 3
    assert samples["specmesh_x_bucket", "+Inf"] == 4 == samples["specmesh_x_count", None]
    assert samples["specmesh_x_sum", None] == 8.5
    with pytest.raises(ValueError, match="different bounds"):
        histogram_family("specmesh_x", "x", [a, Buckets((1, 2))])


# ------------------------------------------------------------------ drafter
def test_drafter_counts_by_proposer():
    open_sessions = {"copy": 2, "retrieval": 0}
    metrics = DrafterMetrics(sessions=lambda: open_sessions, model_name=MODEL)
    r = metrics.registry
    metrics.proposed("copy", 5, 0.002, num_feedback=2)
    metrics.proposed("copy", 0, 0.001)
    metrics.proposed("retrieval", 7, 0.004, num_feedback=1)
    metrics.proposed("copy", 0, 0.0, num_feedback=3, drafted=False)  # a context sync
    assert value(r, "drafter_proposals_total", proposer="copy") == 2
    assert value(r, "drafter_proposals_total", proposer="retrieval") == 1
    assert value(r, "drafter_proposed_nodes_total", proposer="copy") == 5
    assert value(r, "drafter_tree_nodes_bucket", proposer="copy", le="0.0") == 1
    assert value(r, "drafter_proposal_seconds_count", proposer="copy") == 2
    assert value(r, "drafter_proposal_seconds_sum", proposer="copy") == pytest.approx(0.003)
    assert value(r, "drafter_context_syncs_total", proposer="copy") == 1
    assert value(r, "drafter_feedback_items_total", proposer="copy") == 5
    assert value(r, "drafter_num_sessions", proposer="copy") == 2
    open_sessions["copy"] = 0
    assert value(r, "drafter_num_sessions", proposer="copy") == 0


# ------------------------------------------------------------------ option and endpoint
def test_metrics_option_parses_host_and_port():
    parser = argparse.ArgumentParser()
    add_metrics_argument(parser)
    assert parser.parse_args([]).metrics is None
    assert parser.parse_args(["--metrics", "127.0.0.1:0"]).metrics == "127.0.0.1:0"
    assert parser.parse_args(["--metrics", "[::1]:9100"]).metrics == "[::1]:9100"
    for bad in ("9100", "host:", ":9100", "host:http", "host:70000"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--metrics", bad])


def test_metrics_endpoint_serves_the_registry_and_refuses_a_port_in_use():
    metrics = ServeMetrics(MODEL)
    metrics.request().finished("stop", 3, 2)
    port = start_metrics_server("127.0.0.1:0", metrics.registry)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'specmesh_request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert "python_gc" not in text  # its own registry, not the process-wide default
    with pytest.raises(SystemExit) as exc:
        start_metrics_server(f"127.0.0.1:{port}", CollectorRegistry())
    message = str(exc.value)
    assert f"127.0.0.1:{port}" in message and "\n" not in message


def test_registry_labels_every_sample_and_keeps_the_names():
    """A Ray Serve replica's registry: `replica`, `deployment`, `application` on every sample of every kind of
    metric (children, custom collectors, histograms), the names and the metrics' own labels unchanged."""
    labels = {"replica": "r1", "deployment": "Drafter", "application": "app"}
    plain, labelled = DrafterMetrics(sessions=lambda: {"copy": 1}, model_name=MODEL, proposers=("copy",)), \
        DrafterMetrics(Registry(labels), sessions=lambda: {"copy": 1}, model_name=MODEL, proposers=("copy",))
    for metrics in (plain, labelled):
        metrics.proposed("copy", 4, 0.002)
    before = {(s.name, tuple(sorted(s.labels.items())), s.value) for f in plain.registry.collect() for s in f.samples}
    after = {(s.name, tuple(sorted({k: v for k, v in s.labels.items() if k not in labels}.items())), s.value)
             for f in labelled.registry.collect() for s in f.samples}
    assert before == after and before
    samples = [s for f in labelled.registry.collect() for s in f.samples]
    assert all(labels.items() <= s.labels.items() for s in samples)
    assert {s.name for s in samples} >= {"specmesh_drafter_proposals_total", "specmesh_drafter_proposal_seconds_bucket",
                                         "specmesh_drafter_num_sessions"}
    assert 'replica="r1"' in generate_latest(labelled.registry).decode()

    clashing = Registry({"model_name": "other"})  # a metric's own label is never overwritten
    ServeMetrics(MODEL, clashing)
    with pytest.raises(ValueError, match="model_name"):
        list(clashing.collect())


def test_metrics_server_answers_its_extra_routes_under_the_same_token():
    metrics = ServeMetrics(MODEL)
    port = start_metrics_server("127.0.0.1:0", metrics.registry, MetricsAccess(("s3cret",)),
                                {"/targets": lambda: (b'[{"targets": []}]', "application/json")})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/targets", headers={"Authorization": "Bearer s3cret"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.headers["Content-Type"] == "application/json" and reply.read() == b'[{"targets": []}]'
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/targets", timeout=10)
    assert refused.value.code == 401
    assert scrape_status(f"http://127.0.0.1:{port}/metrics", token="s3cret") == 200


def scrape_status(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> int:
    """The status of GET ``url`` as a Prometheus scrape sends it (bearer token, client certificate in
    ``context``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10,
                                    context=context) as reply:
            assert b"specmesh_request_success_total" in reply.read()
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_metrics_endpoint_takes_the_api_ports_tls_client_certificates_and_token(tmp_path):
    pki = make_pki(tmp_path)
    metrics = ServeMetrics(MODEL)
    metrics.request().finished("stop", 3, 2)
    access = MetricsAccess(("s3cret", "other"), pki["server"], pki["server_key"], pki["ca"])
    port = start_metrics_server("127.0.0.1:0", metrics.registry, access)
    url = f"https://127.0.0.1:{port}/metrics"
    with_cert = ssl.create_default_context(cafile=pki["ca"])
    with_cert.load_cert_chain(pki["client"], pki["client_key"])
    assert scrape_status(url, with_cert, "s3cret") == 200
    assert scrape_status(url, with_cert, "other") == 200
    assert scrape_status(url, with_cert) == 401  # no token
    assert scrape_status(url, with_cert, "wrong") == 401
    no_cert = ssl.create_default_context(cafile=pki["ca"])
    with pytest.raises((urllib.error.URLError, ssl.SSLError, OSError)):
        scrape_status(url, no_cert, "s3cret")  # mutual TLS: no client certificate, no answer
    with pytest.raises((urllib.error.URLError, OSError)):
        scrape_status(url.replace("https://", "http://"), token="s3cret")  # no plaintext answer on the port
    assert scrape_status(url, with_cert, "s3cret") == 200  # the failed handshakes held nothing up
    # TLS without client certificates, no token: the certificate alone
    port = start_metrics_server("127.0.0.1:0", metrics.registry, MetricsAccess((), pki["server"], pki["server_key"]))
    assert scrape_status(f"https://127.0.0.1:{port}/metrics", no_cert) == 200
    # a client that opens a connection and says nothing holds up no other scrape
    import socket

    silent = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        assert scrape_status(f"https://127.0.0.1:{port}/metrics", no_cert) == 200
    finally:
        silent.close()
