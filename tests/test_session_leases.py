"""Sessions die with their caller: a verifier frees the sessions (and KV blocks) of a `serve` that is gone within
seconds of its connection closing (the caller's Lease stream ending), not at --session-ttl; a live caller keeps
them; a draining verifier ends its lease streams at once instead of holding its shutdown for --grace.

Real processes on 127.0.0.1 (tests/service_helpers.py).
"""

from __future__ import annotations

import time

import grpc
import pytest
import service_helpers as sh

from specmesh.client import Client
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.leases import Leases

PROMPT = "def fibonacci(n):"
NUM_STREAMS = 8
FREED_WITHIN = 5.0  # seconds from the caller's kill -9 to every session and KV block freed (issue 71)


def verifier_info(service: sh.Service) -> verifier_pb2.VerifierInfo:
    with sh.channel(service) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.InfoRequest(), timeout=5)


def freed(service: sh.Service) -> bool:
    info = verifier_info(service)
    return info.num_sessions == 0 and info.kv_blocks_free == info.kv_blocks_total


def test_a_lease_attached_again_within_its_grace_keeps_its_sessions():
    leases = Leases(grace=2.0)
    leases.attach("caller\nA", 0.0)
    leases.add_session("caller\nA", "caller\ns1", 0.0)
    leases.detach("caller\nA", 1.0)  # a blip: the caller reconnects
    assert leases.expired(2.5) == []
    leases.attach("caller\nA", 2.5)
    assert leases.expired(100.0) == []  # held: never expires
    leases.detach("caller\nA", 101.0)
    assert leases.expired(102.9) == []
    assert leases.expired(103.1) == ["caller\ns1"]
    assert leases.num_leases == 0


def test_a_released_session_leaves_its_lease_and_a_draining_replica_expires_none():
    leases = Leases(grace=2.0)
    leases.add_session("L", "s1", 0.0)  # named, never attached
    leases.add_session("L", "s2", 0.0)
    leases.drop_session("s1")  # Release
    leases.keep_only({"s1"})  # s2 ended on the replica itself
    assert leases.num_leases == 0
    leases.add_session("L", "s3", 0.0)
    leases.frozen = True
    assert leases.expired(10.0) == []


@pytest.fixture(scope="module")
def mesh():
    """A verifier with the default --session-ttl (600 s: the backstop never fires here) and a drafter."""
    v, d = sh.verifier(), sh.drafter()
    try:
        yield sh.start_all(v, d)
    finally:
        for s in (v, d):
            s.stop()


def open_streams(client: Client, n: int) -> list:
    """``n`` streams, each past its first chunk (its session holds KV blocks on the verifier). Keep the list: a
    stream's generator cancels its call when collected, and serve then releases the session itself."""
    streams = [client.stream(PROMPT, max_new_tokens=1500, ignore_eos=True) for _ in range(n)]
    for stream in streams:
        next(stream)
    return streams


def test_kill_9_of_serve_frees_its_sessions_on_the_verifier_within_seconds(mesh):
    v, d = mesh
    s = sh.serve([v], [d]).wait_ready()
    try:
        with Client(s.address, timeout=120) as client:
            streams = open_streams(client, NUM_STREAMS)  # held open: only the kill may end them
            held = verifier_info(v)
            assert held.num_sessions == NUM_STREAMS
            assert held.kv_blocks_free < held.kv_blocks_total
            s.kill()  # no Release will ever come
            killed = time.monotonic()
            assert sh.wait_until(lambda: freed(v), timeout=FREED_WITHIN), verifier_info(v)
            print(f"sessions freed {time.monotonic() - killed:.2f} s after kill -9 of serve")
            del streams
    finally:
        s.stop()


def test_a_restarted_serve_gets_a_clean_verifier_and_serves(mesh):
    """A killed serve's sessions are gone by the time a new one has started, and the new one serves."""
    v, d = mesh
    first = sh.serve([v], [d]).wait_ready()
    try:
        with Client(first.address, timeout=120) as client:
            streams = open_streams(client, 2)
            first.kill()  # with its streams open: no Release comes
            del streams
    finally:
        first.stop()
    second = sh.serve([v], [d]).wait_ready()
    try:
        assert sh.wait_until(lambda: freed(v), timeout=FREED_WITHIN)
        with Client(second.address, timeout=120) as client:
            assert len(client.generate(PROMPT, max_new_tokens=8, ignore_eos=True).token_ids) == 8
    finally:
        second.stop()


def test_a_live_caller_keeps_its_sessions_while_they_sit_idle(mesh):
    """Held by a live Lease stream, a session with no call for longer than the lease's grace stays."""
    v, _ = mesh
    with sh.channel(v) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        lease = stub.Lease(verifier_pb2.LeaseRequest(lease_id="test-lease"))
        next(lease)  # attached
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="idle", prompt=[1, 2, 3], lease_id="test-lease"),
                     timeout=30)
        time.sleep(FREED_WITHIN)
        assert verifier_info(v).num_sessions == 1
        lease.cancel()  # the caller goes: its session follows
        assert sh.wait_until(lambda: freed(v), timeout=FREED_WITHIN)


def test_a_session_whose_lease_never_attaches_is_freed(mesh):
    v, _ = mesh
    with sh.channel(v) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="orphan", prompt=[1, 2, 3], lease_id="never"),
                     timeout=30)
        assert sh.wait_until(lambda: freed(v), timeout=FREED_WITHIN)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="orphan"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_sigterm_of_a_verifier_with_an_attached_serve_is_not_held_by_the_lease():
    """The lease stream is a call in flight: the drain ends it at once, so an idle verifier stops well inside
    its --grace."""
    v = sh.verifier("--grace", "20").wait_ready()
    s = sh.serve([v], [], "--proposer", "none").wait_ready()
    try:
        with Client(s.address, timeout=60) as client:
            client.generate(PROMPT, max_new_tokens=4)  # the lease is attached by now
        started = time.monotonic()
        v.proc.send_signal(15)
        assert v.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 10
    finally:
        s.stop()
        v.stop()
