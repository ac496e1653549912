"""Bearer tokens and mutual TLS on every specmesh port, internal credentials apart from the clients', and
sessions owned by the caller that opened them (real processes on 127.0.0.1)."""

from __future__ import annotations

import re
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
import service_helpers as sh
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_helpers import make_pki

from specmesh.client import Client
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specmesh.wire import sampling_to_proto, tree_to_proto

TOKEN = "s3cret-token-for-tests"  # what clients of serve present
INTERNAL = "internal-token-of-the-mesh"  # what serve presents to verifiers and drafters; clients never see it
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def token_mesh():
    internal = {"SPECMESH_TOKEN": INTERNAL}
    services = []
    try:
        v, d = sh.verifier(env=internal), sh.drafter(env=internal)
        services += [v, d]
        sh.start_all(v, d)
        s = sh.serve([v], [d], env={"SPECMESH_TOKEN": TOKEN, "SPECMESH_UPSTREAM_TOKEN": INTERNAL})
        services.append(s)
        yield {"verifier": v.wait_ready() and v, "drafter": d, "serve": s.wait_ready()}
    finally:
        for svc in services:
            svc.stop()


def _unauthenticated(call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_generate_needs_the_token(token_mesh, demo_stack):
    address = token_mesh["serve"].address
    _unauthenticated(lambda: Client(address, timeout=30).generate(PROMPT, max_new_tokens=8))
    _unauthenticated(lambda: Client(address, token="wrong", timeout=30).generate(PROMPT, max_new_tokens=8))
    _unauthenticated(lambda: list(Client(address, timeout=30).stream(PROMPT, max_new_tokens=8)))
    good = Client(address, token=TOKEN, timeout=60).generate(PROMPT, max_new_tokens=24, proposer="draft_model")
    want = demo_stack.engine(None).generate(demo_stack.tokenizer.encode(PROMPT), SamplingParams(max_new_tokens=24))
    assert good.token_ids == want.token_ids  # the orchestrator's own hops carry the internal token
    assert good.stats["draft_errors"] == 0


def test_token_file(token_mesh, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert Client(token_mesh["serve"].address, token_file=path, timeout=60).generate(PROMPT, max_new_tokens=4).token_ids


@pytest.mark.parametrize("which", ["verifier", "drafter", "serve"])
def test_every_port_refuses_calls_without_its_token_except_health(token_mesh, which):
    ch = sh.channel(token_mesh[which])
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
    _unauthenticated(lambda: list(reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
    # the clients' token opens serve only: a user cannot call verifiers and drafters directly (issue 17)
    client = (("authorization", f"Bearer {TOKEN}"),)
    internal = (("authorization", f"Bearer {INTERNAL}"),)
    if which == "verifier":
        stub = verifier_pb2_grpc.VerifierStub(ch)
        _unauthenticated(lambda: stub.Info(verifier_pb2.InfoRequest(), timeout=5))
        _unauthenticated(lambda: stub.Prefill(verifier_pb2.PrefillRequest(session_id="x", prompt=[1, 2]), timeout=5))
        for wrong in ((("authorization", "Bearer nope"),), client):
            _unauthenticated(lambda wrong=wrong: stub.Info(verifier_pb2.InfoRequest(), timeout=5, metadata=wrong))
            _unauthenticated(lambda wrong=wrong: stub.Prefill(
                verifier_pb2.PrefillRequest(session_id="x", prompt=[1, 2]), timeout=5, metadata=wrong))
        info = stub.Info(verifier_pb2.InfoRequest(), timeout=5, metadata=internal)
        assert info.vocab_size > 0
        assert info.model == "demo"  # the model's name, never its directory on the verifier's machine
    if which == "drafter":
        stub = drafter_pb2_grpc.DrafterStub(ch)
        opening = drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id="x", prompt=[1, 2]))
        for wrong in ((), client):
            _unauthenticated(lambda wrong=wrong: stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5,
                                                           metadata=wrong))
            _unauthenticated(lambda wrong=wrong: list(stub.Session(iter([opening]), timeout=5, metadata=wrong)))
        assert stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5, metadata=internal).proposers
    if which == "serve":
        stub = generate_pb2_grpc.GenerateStub(ch)
        request = generate_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(max_new_tokens=1))
        _unauthenticated(lambda: stub.Generate(request, timeout=10, metadata=internal))


def test_serve_refuses_to_forward_a_client_token(tmp_path):
    """serve's internal credential must differ from every token its clients may present; without any, a
    verifier that wants one refuses serve at start-up, with a message naming the option."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# clients\n{TOKEN}\nanother-client\n")
    v = sh.verifier(env={"SPECMESH_TOKEN": INTERNAL})
    services = [v]
    try:
        v.wait_ready()
        same = sh.serve([v], [], "--token-file", str(tokens), "--connect-timeout", "5",
                        env={"SPECMESH_UPSTREAM_TOKEN": "another-client"})
        none = sh.serve([v], [], "--token-file", str(tokens), "--connect-timeout", "5")
        services += [same, none]
        assert "the upstream token is also a client token" in same.wait_exit(30)
        assert "UNAUTHENTICATED" in none.wait_exit(30)
    finally:
        for svc in services:
            svc.stop()


def _ownership(alice, bob, info) -> None:
    """alice, bob: (VerifierStub, call metadata) of two authenticated callers of one verifier."""
    (a, a_md), (b, b_md) = alice, bob
    greedy = sampling_to_proto(SamplingParams(max_new_tokens=8))

    def prefill(stub, md, sid, prompt):
        return stub.Prefill(verifier_pb2.PrefillRequest(session_id=sid, prompt=prompt, sampling=greedy),
                            timeout=30, metadata=md)

    def verify(stub, md, sid):
        return list(stub.Verify(verifier_pb2.VerifyRequest(session_id=sid, tree=tree_to_proto(TokenTree.empty())),
                                timeout=30, metadata=md).tokens)

    def code(call):
        with pytest.raises(grpc.RpcError) as err:
            call()
        return err.value.code(), err.value.details()

    prefill(a, a_md, "s", [5, 6, 7])
    prefill(a, a_md, "ref", [5, 6, 7])  # the same prompt under another id: what "s" must go on producing
    # another caller cannot reach alice's session, nor tell it exists
    for call in (lambda: verify(b, b_md, "s"),
                 lambda: b.Release(verifier_pb2.ReleaseRequest(session_id="s"), timeout=10, metadata=b_md)):
        status, details = code(call)
        assert status == grpc.StatusCode.NOT_FOUND and "'s'" in details
    item = verifier_pb2.VerifyRequest(session_id="s", tree=tree_to_proto(TokenTree.empty()))  # nor in a batch
    (outcome,) = b.VerifyBatch(verifier_pb2.VerifyBatchRequest(items=[item]), timeout=30, metadata=b_md).items
    assert outcome.code == grpc.StatusCode.NOT_FOUND.value[0] and "'s'" in outcome.message
    assert "token:" not in outcome.message and "cert:" not in outcome.message
    prefill(b, b_md, "s", [9, 9, 9, 9])  # bob's own "s": no conflict, no hint that the id is taken
    assert verify(a, a_md, "s") == verify(a, a_md, "ref")
    assert verify(b, b_md, "s")
    status, details = code(lambda: prefill(a, a_md, "s", [1]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "'s' already exists" in details
    assert "token:" not in details and "cert:" not in details  # the verifier's internal key stays inside
    for stub, md in ((a, a_md), (b, b_md)):
        stub.Release(verifier_pb2.ReleaseRequest(session_id="s"), timeout=10, metadata=md)
    a.Release(verifier_pb2.ReleaseRequest(session_id="ref"), timeout=10, metadata=a_md)
    assert code(lambda: b.Release(verifier_pb2.ReleaseRequest(session_id="s"), timeout=10, metadata=b_md))[0] \
        == grpc.StatusCode.NOT_FOUND
    assert info().num_sessions == 0


def _in_callers_terms(err: grpc.RpcError, session_id: str) -> None:
    """A refusal that names the caller's own session id and never the verifier's internal key."""
    details = err.details()
    assert f"'{session_id}'" in details, details
    assert "token:" not in details and "cert:" not in details and "\\n" not in details and "\n" not in details


def test_a_release_racing_its_prefill_answers_in_the_callers_terms():
    """A Release of a session whose Prefill is still running: the Prefill ends ABORTED naming the caller's id (it
    answered UNKNOWN with the verifier's key `token:<hash>\\n<id>`), the session's KV goes back, nothing is left.
    A Release racing a Verify answers as cleanly (OK, ABORTED or NOT_FOUND)."""
    v = sh.verifier("--prefill-chunk", "16", "--no-cost-profile", env={"SPECMESH_TOKEN": INTERNAL})
    try:
        stub = verifier_pb2_grpc.VerifierStub(sh.channel(v.wait_ready()))
        md = (("authorization", f"Bearer {INTERNAL}"),)
        greedy = sampling_to_proto(SamplingParams(max_new_tokens=8))

        def release(sid: str) -> bool:
            """True if released; NOT_FOUND (no such session yet, or any more) is False."""
            try:
                stub.Release(verifier_pb2.ReleaseRequest(session_id=sid), timeout=10, metadata=md)
                return True
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND, (err.code(), err.details())
                _in_callers_terms(err, sid)
                return False

        aborted = 0
        for i in range(4):
            sid = f"race-{i}"
            # 1500 tokens in chunks of 16: ~90 steps, so the Release lands while the prefill runs
            prefill = stub.Prefill.future(verifier_pb2.PrefillRequest(session_id=sid, prompt=[5] * 1500,
                                                                      sampling=greedy), timeout=60, metadata=md)
            released = False
            while not released and not prefill.done():  # NOT_FOUND until the verifier has the Prefill
                released = release(sid)
            try:
                prefill.result()
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED, (err.code(), err.details())
                _in_callers_terms(err, sid)
                aborted += 1
            if not released:  # the Prefill won the race
                assert release(sid)
        assert aborted  # the race did happen
        empty = tree_to_proto(TokenTree.empty())
        for i in range(8):
            sid = f"verify-race-{i}"
            stub.Prefill(verifier_pb2.PrefillRequest(session_id=sid, prompt=[5, 6, 7], sampling=greedy), timeout=30,
                         metadata=md)
            verify = stub.Verify.future(verifier_pb2.VerifyRequest(session_id=sid, tree=empty), timeout=30, metadata=md)
            release(sid)
            try:
                verify.result()
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND), (err.code(), err.details())
                _in_callers_terms(err, sid)
            release(sid)  # NOT_FOUND: released above
        assert stub.Info(verifier_pb2.InfoRequest(), timeout=5, metadata=md).num_sessions == 0
    finally:
        v.stop()


def test_sessions_belong_to_the_token_that_opened_them(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")  # two callers of one verifier
    v = sh.verifier("--token-file", str(tokens))
    try:
        stub = verifier_pb2_grpc.VerifierStub(sh.channel(v.wait_ready()))
        alice, bob = ((("authorization", "Bearer alice-token"),), (("authorization", "Bearer bob-token"),))
        _ownership((stub, alice), (stub, bob), lambda: stub.Info(verifier_pb2.InfoRequest(), timeout=5,
                                                                 metadata=alice))
    finally:
        v.stop()


def test_sessions_belong_to_the_client_certificate_that_opened_them(tmp_path):
    pki = make_pki(tmp_path)
    v = sh.verifier("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"]))
    try:
        v.wait_ready()

        def stub(role):  # two certificates of one CA, common names "specmesh client" and "specmesh server"
            creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), pki[f"{role}_key"].read_bytes(),
                                                 pki[role].read_bytes())
            return verifier_pb2_grpc.VerifierStub(grpc.secure_channel(v.address, creds))

        alice, bob = stub("client"), stub("server")
        _ownership((alice, ()), (bob, ()), lambda: alice.Info(verifier_pb2.InfoRequest(), timeout=5))
    finally:
        v.stop()


METRICS_URL = re.compile(r"Prometheus metrics at (https?://127\.0\.0\.1:\d+/metrics)")


def metrics_status(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> int:
    """GET ``url`` as a Prometheus scrape config with ``authorization`` and ``tls_config`` sends it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10, context=context) as r:
            assert b"specmesh_" in r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def assert_metrics_port_like_the_api(service: sh.Service, pki: dict, token: str) -> None:
    """The --metrics port of ``service`` (TLS, client certificates, ``token``) answers only as its API would."""
    found = METRICS_URL.search(service.log_text())
    assert found, service.log_text()
    url = found.group(1)
    assert url.startswith("https://"), url
    with_cert = ssl.create_default_context(cafile=pki["ca"])
    with_cert.load_cert_chain(pki["client"], pki["client_key"])
    assert metrics_status(url, with_cert, token) == 200
    assert metrics_status(url, with_cert) == 401
    assert metrics_status(url, with_cert, TOKEN if token != TOKEN else INTERNAL) == 401
    with pytest.raises((urllib.error.URLError, ssl.SSLError, OSError)):
        metrics_status(url, ssl.create_default_context(cafile=pki["ca"]), token)  # no client certificate
    with pytest.raises((urllib.error.URLError, OSError)):
        metrics_status(url.replace("https://", "http://"), token=token)  # no plaintext


def test_mutual_tls(tmp_path, demo_stack):
    pki = make_pki(tmp_path)
    tls = ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"])]
    metrics = ["--metrics", "127.0.0.1:0"]
    v = sh.verifier(*tls, *metrics, "--no-cost-profile", env={"SPECMESH_TOKEN": INTERNAL})
    d = sh.Service(["-m", "specmesh", "drafter", "--draft", "none", "--proposers", "prompt_lookup", *tls, *metrics],
                   {"SPECMESH_TOKEN": INTERNAL}, "drafter")
    services = [v, d]
    try:
        sh.start_all(v, d)
        # every port of the mesh under one posture: the metrics ports take the certificates and the token too
        assert_metrics_port_like_the_api(v, pki, INTERNAL)
        assert_metrics_port_like_the_api(d, pki, INTERNAL)
        # serve presents the server certificate as its client certificate to the verifier (same CA), and the
        # internal token; its clients present their own certificate and token
        upstream = ["--upstream-tls-ca", str(pki["ca"]), "--upstream-tls-cert", str(pki["server"]),
                    "--upstream-tls-key", str(pki["server_key"])]
        s = sh.serve([v], [], "--proposer", "prompt_lookup", "--connect-timeout", "20", *tls, *upstream, *metrics,
                     env={"SPECMESH_TOKEN": TOKEN, "SPECMESH_UPSTREAM_TOKEN": INTERNAL})
        services.append(s)
        s.wait_ready()
        assert_metrics_port_like_the_api(s, pki, TOKEN)
        client = Client(s.address, token=TOKEN, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"],
                        timeout=60)
        assert client.generate(PROMPT, max_new_tokens=8).token_ids
        # serve without a client certificate of its own: a one-line error that names the missing options
        no_cert = sh.serve([v], [], "--connect-timeout", "3", "--upstream-tls-ca", str(pki["ca"]),
                           env={"SPECMESH_UPSTREAM_TOKEN": INTERNAL})
        services.append(no_cert)
        log = no_cert.wait_exit(60)
        assert "--upstream-tls-cert" in log and "Traceback" not in log, log
        # no client certificate, or no TLS at all: the handshake fails
        for bad in (Client(s.address, token=TOKEN, tls_ca=pki["ca"], timeout=10),
                    Client(s.address, token=TOKEN, timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                bad.generate(PROMPT, max_new_tokens=4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for svc in services:
            svc.stop()


def test_private_ca_without_client_certificates(tmp_path):
    """--upstream-tls-ca makes serve trust the private CA of verifiers that ask no client certificate, for
    clients of serve with or without TLS (issue 17: this needed an undocumented
    GRPC_DEFAULT_SSL_ROOTS_FILE_PATH before)."""
    pki = make_pki(tmp_path)
    cert = ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"])]
    trust = ["--upstream-tls-ca", str(pki["ca"])]
    v = sh.verifier(*cert)  # TLS, no client certificates asked
    services = [v]
    try:
        v.wait_ready()
        plain = sh.serve([v], [], "--proposer", "prompt_lookup", "--connect-timeout", "20", *trust)
        tls = sh.serve([v], [], "--proposer", "prompt_lookup", "--connect-timeout", "20", *cert, *trust)
        services += [plain, tls]
        sh.start_all(plain, tls)
        assert Client(plain.address, timeout=60).generate(PROMPT, max_new_tokens=4).token_ids
        assert Client(tls.address, tls_ca=pki["ca"], timeout=60).generate(PROMPT, max_new_tokens=4).token_ids
    finally:
        for svc in services:
            svc.stop()


def test_serve_asks_for_the_tokenizer_of_a_model_named_by_the_verifiers():
    """Info names the model (never its directory), so serve can no longer guess a tokenizer directory from it:
    the demo model's is bundled; any other needs --tokenizer, said in one line rather than a wrong vocabulary."""
    import argparse

    from orchestrator.server import load_tokenizer
    from specmesh.models import demo_model

    args = argparse.Namespace(tokenizer=None, command="serve")
    assert load_tokenizer(args, "demo")[0] == demo_model("target")
    with pytest.raises(SystemExit) as exc:
        load_tokenizer(args, "stdlib-code")
    assert "--tokenizer" in str(exc.value) and "stdlib-code" in str(exc.value)
