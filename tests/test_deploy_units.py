"""The Ray Serve application's pure parts, without a cluster: membership, scrape targets and autoscale gauges,
autoscaling policies, option checks."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from prometheus_client import generate_latest

pytest.importorskip("ray")  # the [ray] extra

from specmesh_app import autoscaling, fleet_metrics  # noqa: E402
from specmesh_app.deploy import AppArgs, DraftLoad, ServeCallContext, application, build_app, parse_options  # noqa: E402
from specmesh_app.membership import Roster  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_roster_forgets_a_replica_silent_for_its_ttl_and_a_withdrawn_one_at_once():
    clock = Clock()
    roster = Roster(ttl=6.0, clock=clock)
    roster.announce("verifier", "a", "10.0.0.1:5000")
    roster.announce("verifier", "b", "10.0.0.2:5000")
    roster.announce("drafter", "c", "10.0.0.3:5000")
    assert roster.members("verifier") == ["10.0.0.1:5000", "10.0.0.2:5000"]
    assert roster.members("drafter") == ["10.0.0.3:5000"]
    clock.now = 5.0
    roster.announce("verifier", "a", "10.0.0.1:5000")  # a heartbeat
    clock.now = 6.5  # b silent for 6.5 s: killed without a goodbye
    assert roster.members("verifier") == ["10.0.0.1:5000"]
    roster.withdraw("verifier", "a")  # a draining replica
    assert roster.members("verifier") == []
    roster.announce("verifier", "a2", "10.0.0.1:6000")  # a restarted replica, on a new port
    assert roster.members("verifier") == ["10.0.0.1:6000"]


def test_roster_keeps_what_replicas_announce_for_the_scrape_targets():
    clock = Clock()
    roster = Roster(ttl=6.0, clock=clock)
    roster.announce("verifier", "v1", "10.0.0.1:5000", deployment="Verifier", metrics="10.0.0.1:6000",
                    model_name="target", signals={"sessions": 3.0, "kv_usage": 0.5})
    roster.announce("verifier", "v2", "10.0.0.2:5000", deployment="Verifier", metrics="10.0.0.2:6000",
                    model_name="target", signals={"sessions": 1.0, "kv_usage": 0.25})
    roster.announce("drafter", "d1", "10.0.0.3:5000", deployment="Drafter", metrics="10.0.0.3:6000",
                    signals={"draft_busy": 0.5, "draft_latency_ms": 10.0})
    roster.announce("drafter", "d2", "10.0.0.4:5000", deployment="Drafter", signals={"draft_busy": 0.25,
                                                                                      "draft_latency_ms": 30.0})
    roster.announce("orchestrator", "o1", "", deployment="Orchestrator", metrics="10.0.0.5:6000", model_name="served")
    assert roster.members("verifier") == ["10.0.0.1:5000", "10.0.0.2:5000"]  # the gRPC addresses, as before
    assert roster.model_name() == "served"  # the orchestrator's name for the model, else a verifier's
    live = roster.live()
    document = fleet_metrics.targets(live, "app")
    assert document == [  # sorted by replica; d2 announced no metrics port
        {"targets": ["10.0.0.3:6000"], "labels": {"deployment": "Drafter", "replica": "d1", "application": "app"}},
        {"targets": ["10.0.0.5:6000"], "labels": {"deployment": "Orchestrator", "replica": "o1", "application": "app"}},
        {"targets": ["10.0.0.1:6000"], "labels": {"deployment": "Verifier", "replica": "v1", "application": "app"}},
        {"targets": ["10.0.0.2:6000"], "labels": {"deployment": "Verifier", "replica": "v2", "application": "app"}}]
    # summed as the policies sum them; the latency averaged, as drafter_replicas averages it
    assert fleet_metrics.pool_signals(live.values()) == {
        "Verifier": {"sessions": 4.0, "kv_usage": 0.75}, "Drafter": {"draft_busy": 0.75, "draft_latency_ms": 20.0}}
    clock.now = 7.0
    roster.announce("verifier", "v1", "10.0.0.1:5000", deployment="Verifier", metrics="10.0.0.1:6000")
    assert [g["labels"]["replica"] for g in fleet_metrics.targets(roster.live(), "app")] == ["v1"]  # the rest fell silent
    assert fleet_metrics.pool_signals(roster.live().values()) == {}  # v1 reported nothing this time


def test_targets_file_is_replaced_whole(tmp_path):
    path = tmp_path / "targets" / "specmesh.json"  # its directory made on the way
    document = [{"targets": ["127.0.0.1:1"], "labels": {"deployment": "Verifier"}}]
    fleet_metrics.write_targets(path, document)
    assert json.loads(path.read_text()) == document
    fleet_metrics.write_targets(path, [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["specmesh.json"]  # no temporary left for file_sd's glob


def test_autoscale_gauges_read_serves_targets_from_its_instance_details():
    """replica_counts reads the dict Serve's controller gives (ServeInstanceDetails): the field names it uses are
    the schema's."""
    from ray.serve.schema import ApplicationDetails, DeploymentDetails, ReplicaDetails, ServeInstanceDetails

    assert "applications" in ServeInstanceDetails.model_fields and "deployments" in ApplicationDetails.model_fields
    assert {"target_num_replicas", "replicas"} <= DeploymentDetails.model_fields.keys()
    assert "state" in ReplicaDetails.model_fields
    details = {"applications": {
        "app": {"deployments": {"Verifier": {"target_num_replicas": 3, "replicas": [{"state": "RUNNING"},
                                                                                  {"state": "STARTING"}]},
                                "Drafter": {"target_num_replicas": 1, "replicas": [{"state": "RUNNING"}]}}},
        "other": {"deployments": {"Verifier": {"target_num_replicas": 9, "replicas": []}}}}}
    counts = fleet_metrics.replica_counts(details, "app")
    assert counts == {"Verifier": (3, 1), "Drafter": (1, 1)}
    assert fleet_metrics.replica_counts(details, "gone") == {} == fleet_metrics.replica_counts({}, "app")

    view = fleet_metrics.PoolView("m", {"Verifier": {"sessions": 4.0}}, counts)
    registry = fleet_metrics.AutoscaleMetrics(lambda: view).registry
    value = registry.get_sample_value
    assert value("specmesh_autoscale_signal", {"model_name": "m", "deployment": "Verifier", "signal": "sessions"}) == 4
    assert value("specmesh_autoscale_target_replicas", {"model_name": "m", "deployment": "Verifier"}) == 3
    assert value("specmesh_autoscale_running_replicas", {"model_name": "m", "deployment": "Verifier"}) == 1
    assert value("specmesh_autoscale_target_replicas", {"model_name": "m", "deployment": "Drafter"}) == 1
    empty = fleet_metrics.AutoscaleMetrics(fleet_metrics.PoolView).registry  # before the first reading
    assert b"specmesh_autoscale" in generate_latest(empty)  # HELP/TYPE, no sample
    assert empty.get_sample_value("specmesh_autoscale_target_replicas", {"model_name": "", "deployment": "Verifier"}) \
        is None


def test_drafter_load_gives_each_reader_its_own_window():
    """Serve's autoscaler and Membership's heartbeat read the same drafter: neither takes the other's drafts."""

    class Servicer:
        drafts, draft_seconds = 0, 0.0

    servicer, clock = Servicer(), Clock()
    serve_reads, heartbeat_reads = DraftLoad(servicer, clock), DraftLoad(servicer, clock)
    clock.now, servicer.drafts, servicer.draft_seconds = 1.0, 10, 0.5  # 10 drafts of 50 ms in one second
    assert serve_reads.read() == {autoscaling.DRAFT_BUSY: 0.5, autoscaling.DRAFT_LATENCY_MS: 50.0}
    clock.now = 2.0
    assert heartbeat_reads.read() == {autoscaling.DRAFT_BUSY: 0.25, autoscaling.DRAFT_LATENCY_MS: 50.0}  # 2 s window
    assert serve_reads.read() == {autoscaling.DRAFT_BUSY: 0.0}  # nothing drafted since its last read


def test_verifier_policy_takes_the_larger_need_of_sessions_and_kv_pool():
    def need(sessions, kv, current=2):
        return autoscaling.verifier_replicas(current, {autoscaling.SESSIONS: dict(enumerate(sessions)),
                                                       autoscaling.KV_USAGE: dict(enumerate(kv))}, 8, 0.7)

    assert need([4, 4], [0.1, 0.1]) == 1  # 8 sessions fit one replica
    assert need([8, 9], [0.1, 0.1]) == 3  # 17 sessions need three
    assert need([1, 1], [0.9, 0.8]) == 3  # few sessions, long contexts: the KV pool decides
    assert need([0, 0], [0.0, 0.0]) == 0  # idle: Serve clamps to min_replicas
    assert autoscaling.verifier_replicas(3, {}, 8, 0.7) == 3  # no reports yet: keep the size
    assert autoscaling.verifier_replicas(3, None, 8, 0.7) == 3


def test_drafter_policy_follows_busy_time_and_scales_up_on_slow_proposals():
    def need(busy, latency, current=2):
        metrics = {autoscaling.DRAFT_BUSY: dict(enumerate(busy))}
        if latency is not None:
            metrics[autoscaling.DRAFT_LATENCY_MS] = dict(enumerate(latency))
        return autoscaling.drafter_replicas(current, metrics, 0.6, 20.0)

    assert need([0.3, 0.3], [5, 5]) == 1  # 0.6 of one model thread
    assert need([0.9, 0.9], [10, 10]) == 3  # 1.8 threads busy at 0.6 each
    assert need([0.3, 0.3], [40, 40]) == 4  # proposals twice the target: twice the replicas
    assert need([0.0, 0.0], None) == 0  # nobody drafting
    assert autoscaling.drafter_replicas(2, {}, 0.6, 20.0) == 2


def test_policies_refuse_targets_they_cannot_meet():
    with pytest.raises(ValueError):
        autoscaling.VerifierAutoscaling(target_sessions=0)
    with pytest.raises(ValueError):
        autoscaling.VerifierAutoscaling(target_kv_usage=1.5)
    with pytest.raises(ValueError):
        autoscaling.DrafterAutoscaling(target_busy=0)


def test_options_parse_as_the_commands_do_and_serve_decided_ones_are_refused():
    args = parse_options("verifier", ["--kv-cache-gb", "2", "--dtype", "float32"])
    assert args.kv_cache_gb == 2 and args.command == "verifier"
    with pytest.raises(ValueError, match="--kv-cach"):
        parse_options("verifier", ["--kv-cach-gb", "2"])  # a typo: argparse's own message
    with pytest.raises(ValueError, match="--listen is decided by Ray Serve"):
        parse_options("verifier", ["--listen=0.0.0.0:1"], ("--listen",))


def test_build_app_fails_at_once_on_bad_args():
    with pytest.raises(ValueError, match="--verifier is decided by Ray Serve"):
        application({"serve": ["--verifier", "127.0.0.1:1"]})
    with pytest.raises(ValueError, match="unknown deployments"):
        application({}, {"Verfier": {"num_replicas": 2}})
    with pytest.raises(ValueError):
        application({"drafters": []})  # extra fields are refused, not ignored
    with pytest.raises(ValueError, match="--bogus"):
        build_app({"verifier": ["--bogus"]})  # the import path's builder checks the same way
    assert AppArgs().drafter == []  # a drafter pool by default; None = none
    with pytest.raises(ValueError):
        application({"membership_metrics_port": 70000})


def test_serve_call_context_abort_sets_the_status_the_proxy_sends():
    class Proxy:
        code = details = None

        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

    proxy = Proxy()
    with pytest.raises(RuntimeError, match="bad"):
        asyncio.run(ServeCallContext(proxy).abort(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert (proxy.code, proxy.details) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert ServeCallContext(proxy).time_remaining() is None


class _ProxyContext:
    """What Serve's gRPC proxy hands a deployment method: the call's metadata, a status to set."""

    def __init__(self, metadata) -> None:
        self.metadata, self.code, self.details = metadata, None, None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def test_generate_through_serve_s_grpc_proxy_needs_the_token():
    """Serve's gRPC proxy runs no interceptor: the Orchestrator checks the bearer token itself."""
    from specmesh import rpc
    from specmesh_app.deploy import Orchestrator

    cls = Orchestrator.func_or_class
    orchestrator = cls.__new__(cls)  # only the security settings matter here
    orchestrator.security = rpc.Security(tokens=("s3cret", "other"))
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
        context = _ProxyContext(metadata)
        with pytest.raises(RuntimeError, match="bearer token"):
            asyncio.run(orchestrator._call_context(context))
        assert context.code == grpc.StatusCode.UNAUTHENTICATED
    for token in ("s3cret", "other"):
        context = _ProxyContext([("authorization", f"Bearer {token}")])
        assert asyncio.run(orchestrator._call_context(context)).context is context and context.code is None
    orchestrator.security = rpc.Security()  # no --token-file: open
    assert asyncio.run(orchestrator._call_context(_ProxyContext([]))).context is not None
