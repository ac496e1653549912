"""specmesh on Ray Serve (specmesh_app/deploy.py): a local Ray cluster, the real application, real faults.

One cluster for the module (a Ray start costs seconds). The application serves the bundled demo pair in
float64, so outputs are compared token for token with plain greedy decoding of the embedded engine in this
process. Its replicas are found and scraped by a real Prometheus (tests/prometheus_server.py, skipped where the
binary is absent) through the targets file Membership writes. Ray's CPUs here are logical: replicas reserve 1 (verifier), 0.5 (drafter), 0.25 (orchestrator)
of the 6 declared (two applications at once), on a 2-core
machine.

`pytest -m "not ray"` skips the module.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from orchestrator.embedded import EmbeddedStack
from specmesh.client import Client
from specmesh.sampling import SamplingParams
from tests.prometheus_server import prometheus_binary, prometheus_server
from tests.service_helpers import DRAFT, DRAFT_ARGS, TARGET, TARGET_ARGS, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")  # the [ray] extra
from ray import serve  # noqa: E402

from specmesh_app.deploy import application  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self"]
APP = "specmesh"
VERIFIER_ARGS = [*TARGET_ARGS, "--kv-cache-gb", "0.05", "--no-cost-profile"]
DRAFTER_ARGS = [*DRAFT_ARGS, "--proposers", "prompt_lookup", "draft_model"]
SERVE_ARGS = ["--proposer", "draft_model", "--tokenizer", TARGET]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # replicas report their load every half second (default 10 s): the autoscaling test stays short
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    ports = {"http": free_port(), "grpc": free_port()}
    serve.start(http_options={"host": "127.0.0.1", "port": ports["http"]},
                grpc_options={"port": ports["grpc"],
                              "grpc_servicer_functions": ["specmesh.v1.generate_pb2_grpc.add_GenerateServicer_to_server"]})
    try:
        yield ports
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def stack():
    stack = EmbeddedStack.load(TARGET, DRAFT, torch.float64, kv_cache_gb=0.05)
    yield stack
    stack.close()


def reference(stack, prompt: str, max_new_tokens: int) -> tuple[str, list[int]]:
    """(text, token ids) of plain greedy decoding on the embedded engine."""
    result = stack.engine(None).generate(stack.tokenizer.encode(prompt), SamplingParams(max_new_tokens=max_new_tokens))
    return stack.decode(result.token_ids), result.token_ids


def counted(count_file, initial: int) -> dict:
    """An autoscaling config holding the pool at the count in ``count_file`` (tests/ray_policies.py), changed in
    place by writing the file."""
    count_file.write_text(str(initial))
    return {"min_replicas": 1, "max_replicas": 2, "initial_replicas": initial, "upscale_delay_s": 0,
            "downscale_delay_s": 0, "look_back_period_s": 1.0,
            "policy": {"policy_function": "tests.ray_policies:CountFromFile",
                       "policy_kwargs": {"path": str(count_file)}}}


def main_app(files: dict):
    """Two verifier replicas and one drafter, each pool scaled to the count in its file; the scrape targets in
    ``files["targets"]``."""
    return application({"verifier": VERIFIER_ARGS, "drafter": DRAFTER_ARGS, "serve": SERVE_ARGS,
                        "metrics_targets_file": str(files["targets"])},
                       {"Verifier": {"autoscaling_config": counted(files["verifiers"], 2)},
                        "Drafter": {"autoscaling_config": counted(files["drafters"], 1)}})


def replicas() -> dict[str, list[str]]:
    return serve.get_deployment_handle("Orchestrator", APP).replicas.remote().result()


def pool_is(kind: str, n: int, app: str = APP) -> bool:
    """``n`` replicas of ``kind`` announced (a dead one drops out within 3 heartbeats) and exactly those used by
    the orchestrator."""
    members = serve.get_deployment_handle("Membership", app).members.remote(kind).result()
    used = serve.get_deployment_handle("Orchestrator", app).replicas.remote().result()[kind]
    return len(members) == n and sorted(used) == members


def pools(app: str = APP) -> dict:
    """What each side sees now, for failure messages."""
    return {kind: {"actors": replica_actors({"verifier": "Verifier", "drafter": "Drafter"}[kind], app),
                   "members": serve.get_deployment_handle("Membership", app).members.remote(kind).result(),
                   "used": serve.get_deployment_handle("Orchestrator", app).replicas.remote().result()[kind]}
            for kind in ("verifier", "drafter")}


def replica_actors(deployment: str, app: str = APP) -> list[str]:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill(actor_name: str) -> None:
    """The replica's process dies at once, as on a machine failure (Serve notices and replaces it)."""
    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray")
    files = {"verifiers": directory / "verifiers", "drafters": directory / "drafters",
             "targets": directory / "targets" / "specmesh.json"}
    serve.run(main_app(files), name=APP, route_prefix="/")
    assert wait_until(lambda: pool_is("verifier", 2) and pool_is("drafter", 1), 60)
    yield {**cluster, **files}
    serve.delete(APP)


def complete(port: int, body: dict, route: str = "") -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{route}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def two_streams(port: int, prompt: str, n: int) -> tuple[list[threading.Thread], dict[int, object]]:
    """Two streamed `prompt_lookup` requests in flight, the second started once the first has its first token,
    so that it goes to the other, less loaded, verifier replica: (their threads, index -> tokens or the
    grpc.RpcError it ended with, filled as they end)."""
    outcomes: dict[int, object] = {}
    first_tokens = [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        tokens = []
        try:
            with Client(f"127.0.0.1:{port}", timeout=120) as client:
                for chunk in client.stream(prompt, max_new_tokens=n, proposer="prompt_lookup"):
                    tokens += chunk.token_ids
                    first_tokens[i].set()
            outcomes[i] = tokens
        except grpc.RpcError as exc:
            outcomes[i] = exc
        finally:
            first_tokens[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread, first_token in zip(threads, first_tokens, strict=True):
        thread.start()
        assert first_token.wait(60)
    return threads, outcomes


def interface_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


# --------------------------------------------------------------------------- tests
def test_a_local_cluster_listens_and_connects_on_loopback_only(app):
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    outside = interface_address()
    for kind in ("verifier", "drafter"):
        members = serve.get_deployment_handle("Membership", APP).members.remote(kind).result()
        assert members and all(m.startswith("127.0.0.1:") for m in members), members
        for member in members:  # bound to loopback, not to every interface
            port = int(member.rpartition(":")[2])
            if outside is not None:
                with pytest.raises(OSError):
                    socket.create_connection((outside, port), timeout=2).close()


def test_http_through_serve_matches_embedded_greedy(app, stack):
    for proposer in ("prompt_lookup", "draft_model"):
        for prompt in PROMPTS:
            answer = complete(app["http"], {"model": "demo", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                                            "proposer": proposer})
            assert answer["choices"][0]["text"] == reference(stack, prompt, 40)[0], (proposer, prompt)
            assert answer["specmesh"]["proposer"] == proposer


def test_grpc_through_serve_proxy_matches_embedded_greedy(app, stack):
    with Client(f"127.0.0.1:{app['grpc']}", timeout=120) as client:
        for prompt in PROMPTS:
            _, ids = reference(stack, prompt, 40)
            assert client.generate(prompt, max_new_tokens=40, proposer="draft_model").token_ids == ids
            streamed = [t for chunk in client.stream(prompt, max_new_tokens=40, proposer="prompt_lookup")
                        for t in chunk.token_ids]
            assert streamed == ids
        with pytest.raises(grpc.RpcError) as bad:  # a request error keeps its code through the proxy
            client.generate("x", max_new_tokens=10**6)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_killed_drafter_replica_keeps_the_output_and_comes_back(app, stack):
    prompt, n = PROMPTS[0], 300
    _, ids = reference(stack, prompt, n)
    before = replicas()["drafter"]
    [drafter] = replica_actors("Drafter")
    tokens, killed_at = [], None
    with Client(f"127.0.0.1:{app['grpc']}", timeout=120) as client:
        for chunk in client.stream(prompt, max_new_tokens=n, proposer="draft_model"):
            tokens += chunk.token_ids
            if killed_at is None and len(tokens) >= 20:
                kill(drafter)
                killed_at = len(tokens)
    assert killed_at is not None and killed_at < n  # killed mid-request
    assert tokens == ids
    # Serve starts a new replica; it announces itself and the orchestrator drafts with it again
    assert wait_until(lambda: pool_is("drafter", 1) and replicas()["drafter"] != before, 120), pools()
    answer = complete(app["http"], {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                    "proposer": "draft_model"})
    assert answer["choices"][0]["text"] == reference(stack, prompt, 24)[0]
    assert answer["specmesh"]["draft_errors"] == 0


def test_killed_verifier_replica_fails_only_its_requests(app, stack):
    prompt, n = PROMPTS[1], 400
    _, ids = reference(stack, prompt, n)
    assert pool_is("verifier", 2)
    threads, outcomes = two_streams(app["grpc"], prompt, n)
    kill(replica_actors("Verifier")[0])
    for t in threads:
        t.join(120)
    failed = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes.values() if not isinstance(o, grpc.RpcError)]
    assert len(failed) == 1 and len(served) == 1, outcomes
    assert failed[0].code() == grpc.StatusCode.UNAVAILABLE  # retryable: a retry lands on the live replica
    assert served[0] == ids
    with Client(f"127.0.0.1:{app['grpc']}", timeout=120) as client:  # new requests are served meanwhile
        assert client.generate(prompt, max_new_tokens=16, proposer="prompt_lookup").token_ids == ids[:16]
    assert wait_until(lambda: pool_is("verifier", 2), 120), pools()  # Serve replaced the replica


def test_scale_down_drains_the_stopped_replica(app, stack):
    """Two requests in flight, one per verifier replica; the pool shrinks to one: both finish, identical."""
    prompt, n = PROMPTS[0], 400
    _, ids = reference(stack, prompt, n)
    assert wait_until(lambda: pool_is("verifier", 2), 90)
    # Ray's actor listing can lag Membership by a moment: both replicas listed before the pool shrinks
    assert wait_until(lambda: len(replica_actors("Verifier")) == 2, 60)
    threads, outcomes = two_streams(app["grpc"], prompt, n)
    before = replica_actors("Verifier")
    assert all(t.is_alive() for t in threads)  # both in flight when the pool shrinks
    app["verifiers"].write_text("1")  # Serve stops one replica while both requests run
    assert wait_until(lambda: len(replica_actors("Verifier")) == 1, 60)  # stopped once drained
    for t in threads:
        t.join(120)
    assert outcomes == {0: ids, 1: ids}
    assert set(replica_actors("Verifier")) < set(before)  # the survivor is one of the two, not a new one
    assert wait_until(lambda: pool_is("verifier", 1), 30)
    app["verifiers"].write_text("2")  # as the other tests found it
    assert wait_until(lambda: pool_is("verifier", 2), 90)


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "monitoring" / "grafana" / "specmesh.json"


def pool_panel_queries() -> dict[str, list[str]]:
    """The expressions of the dashboard's "Pools" row by panel title, its variables filled in as Grafana's
    "All" does."""
    panels, queries, in_pools = json.loads(DASHBOARD.read_text())["panels"], {}, False
    for panel in panels:
        if panel["type"] == "row":
            in_pools = panel["title"].startswith("Pools")
        elif in_pools:
            queries[panel["title"]] = [re.sub(r"\$__rate_interval", "30s", re.sub(r"\$(model_name|replica)", ".*",
                                                                                     t["expr"]))
                                       for t in panel["targets"]]
    assert queries, "no Pools row in the dashboard"
    return queries


def replica_ids(deployment: str, app: str = APP) -> set[str]:
    """Serve's ids of the deployment's replicas, from their actors' names (SERVE_REPLICA::app#deployment#id)."""
    return {name.rpartition("#")[2] for name in replica_actors(deployment, app)}


def number(result: list[dict]) -> float:
    (sample,) = result
    return float(sample["value"][1])


def test_every_replica_is_scraped_under_its_own_labels(app, tmp_path):
    """Two verifier and two drafter replicas (and the orchestrator, and Membership), found by a real Prometheus
    in the file Membership writes: each replica's series under its own `replica` label, the autoscale gauges
    with Serve's targets, and every query of the dashboard's per-pool panels answering."""
    prometheus_binary()  # skips without one, before the pool grows
    app["drafters"].write_text("2")
    try:
        assert wait_until(lambda: pool_is("drafter", 2) and pool_is("verifier", 2), 120), pools()
        with prometheus_server(tmp_path, {}, {"specmesh": app["targets"]}) as prometheus:
            def all_up() -> bool:
                up = prometheus.query('up{job="specmesh"}')
                return len(up) == 6 and all(r["value"][1] == "1" for r in up)

            assert prometheus.wait_for(all_up, 60), (prometheus.query("up"), app["targets"].read_text())
            # traffic on every replica: the second request starts while the first runs, so it goes to the other,
            # less loaded, verifier and drafter
            threads, outcomes = two_streams(app["grpc"], PROMPTS[0], 200)
            for t in threads:
                t.join(120)
            assert all(isinstance(o, list) for o in outcomes.values()), outcomes
            for deployment, name in (("Verifier", "specmesh_verifier_kv_blocks"),
                                     ("Drafter", "specmesh_drafter_num_sessions"),
                                     ("Orchestrator", "specmesh_num_requests_running")):
                series = prometheus.query(f'{name}{{application="{APP}"}}')
                assert {r["metric"]["replica"] for r in series} == replica_ids(deployment), (deployment, series)
                assert {(r["metric"]["deployment"], r["metric"]["model_name"]) for r in series} == {(deployment, "demo")}
            # every specmesh series names its replica and deployment (the autoscale gauges: the pool they describe)
            assert not prometheus.query('{__name__=~"specmesh_.+", deployment=""}')
            assert not prometheus.query('{__name__=~"specmesh_.+", __name__!~"specmesh_autoscale_.+", replica=""}')
            for deployment in ("Verifier", "Drafter"):
                assert number(prometheus.query(f'specmesh_autoscale_target_replicas{{deployment="{deployment}"}}')) == 2
                assert number(prometheus.query(f'specmesh_autoscale_running_replicas{{deployment="{deployment}"}}')) == 2

            def drafted_everywhere() -> bool:  # both drafters' proposals counted, scraped after the traffic
                rates = prometheus.query('sum by (replica) (increase(specmesh_drafter_proposals_total[1m])) > 0')
                return len(rates) == 2

            assert prometheus.wait_for(drafted_everywhere, 30), prometheus.query("specmesh_drafter_proposals_total")
            answers = {(title, query): prometheus.query(query)
                       for title, queries in pool_panel_queries().items() for query in queries}
            empty = [key for key, result in answers.items() if not result]
            assert not empty, f"per-pool queries without data: {empty}"
            latency = answers[("Drafter latency per pool", pool_panel_queries()["Drafter latency per pool"][0])]
            assert all(math.isfinite(float(r["value"][1])) for r in latency), latency
    finally:
        app["drafters"].write_text("1")  # as the other tests found it
        assert wait_until(lambda: pool_is("drafter", 1), 120), pools()


def test_verifier_pool_autoscales_up_under_load_and_back_down(cluster, stack, tmp_path):
    """A test-only autoscaling window: one session per replica as the target, sub-second metrics. A real
    Prometheus (found through the application's targets file) records the scale-up and the scale-down: Serve's
    target and the verifier replicas it scrapes, with the sessions signal that drove them."""
    name = "scaling"
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                   "look_back_period_s": 1.0, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                   "policy": {"policy_function": "specmesh_app.autoscaling:VerifierAutoscaling",
                              "policy_kwargs": {"target_sessions": 1}}}
    targets = tmp_path / "targets.json"
    scaling_app = application({"verifier": VERIFIER_ARGS, "drafter": None, "metrics_targets_file": str(targets),
                               "serve": ["--proposer", "prompt_lookup", "--tokenizer", TARGET]},
                              {"Verifier": {"autoscaling_config": autoscaling}})
    prometheus_binary()  # skips without one
    serve.run(scaling_app, name=name, route_prefix="/scaling")
    stop = threading.Event()
    errors: list[Exception] = []
    prompt = PROMPTS[0]
    expected = reference(stack, prompt, 64)[0]
    pool = f'application="{name}", deployment="Verifier"'
    target, scraped = f"specmesh_autoscale_target_replicas{{{pool}}}", f"count(specmesh_verifier_kv_blocks{{{pool}}})"
    sessions = f'specmesh_autoscale_signal{{{pool}, signal="sessions"}}'

    def load() -> None:  # bounded: until told to stop, 90 s at most
        deadline = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                answer = complete(cluster["http"], {"model": "demo", "prompt": prompt, "max_tokens": 64,
                                                    "temperature": 0}, "/scaling")
                assert answer["choices"][0]["text"] == expected
            except Exception as exc:
                errors.append(exc)
                return

    try:
        (tmp_path / "prometheus").mkdir()
        with prometheus_server(tmp_path / "prometheus", {}, {"specmesh": targets}) as prometheus:
            def recorded(expr: str, value: float) -> bool:
                result = prometheus.query(expr)
                return len(result) == 1 and float(result[0]["value"][1]) == value

            assert prometheus.wait_for(lambda: recorded(target, 1) and recorded(scraped, 1), 60), \
                (prometheus.query(target), prometheus.query(scraped))
            began = time.time()
            started = time.monotonic()
            threads = [threading.Thread(target=load) for _ in range(3)]
            for t in threads:
                t.start()
            assert prometheus.wait_for(lambda: recorded(target, 2) and recorded(scraped, 2), 60), \
                ("no scale-up in Prometheus", pools(name), prometheus.query(target), prometheus.query(scraped))
            assert pool_is("verifier", 2, name) or wait_until(lambda: pool_is("verifier", 2, name), 30), pools(name)
            scaled_up = time.monotonic() - started
            stop.set()
            for t in threads:
                t.join(120)
            idle = time.monotonic()
            assert prometheus.wait_for(lambda: recorded(target, 1) and recorded(scraped, 1), 60), \
                ("no scale-down in Prometheus", pools(name), prometheus.query(target), prometheus.query(scraped))
            assert wait_until(lambda: pool_is("verifier", 1, name), 30), pools(name)
            scaled_down = time.monotonic() - idle
            # the run as Prometheus stored it, one point a second
            history = {expr: [float(v) for _, v in prometheus.query_range(expr, began - 2, time.time())[0]["values"]]
                       for expr in (target, scraped, sessions)}
            print(f"autoscaling: 1 -> 2 verifier replicas {scaled_up:.1f} s into the load, 2 -> 1 "
                  f"{scaled_down:.1f} s after it stopped; Prometheus: " +
                  "; ".join(f"{expr}: {' '.join(f'{v:g}' for v in values)}" for expr, values in history.items()))
            assert max(history[sessions]) >= 2  # the signal the policy scaled on, over one session per replica
            assert history[target][0] == 1 and max(history[target]) == 2 and history[target][-1] == 1
            assert history[scraped][0] == 1 and max(history[scraped]) == 2 and history[scraped][-1] == 1
        assert not errors, errors
    finally:
        stop.set()
        serve.delete(name)
