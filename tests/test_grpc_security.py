"""Bearer tokens and mutual TLS on every specmesh port (real processes on 127.0.0.1)."""

from __future__ import annotations

import grpc
import pytest
import service_helpers as sh
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_helpers import make_pki

from specmesh.client import Client
from specmesh.sampling import SamplingParams
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

TOKEN = "s3cret-token-for-tests"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def token_mesh():
    env = {"SPECMESH_TOKEN": TOKEN}
    services = []
    try:
        v, d = sh.verifier(env=env), sh.drafter(env=env)
        services += [v, d]
        sh.start_all(v, d)
        s = sh.serve([v], [d], env=env)
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
    assert good.token_ids == want.token_ids  # the orchestrator's own hops carry the token too
    assert good.stats["draft_errors"] == 0


def test_token_file(token_mesh, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert Client(token_mesh["serve"].address, token_file=path, timeout=60).generate(PROMPT, max_new_tokens=4).token_ids


@pytest.mark.parametrize("which", ["verifier", "drafter", "serve"])
def test_every_port_refuses_calls_without_the_token_except_health(token_mesh, which):
    ch = sh.channel(token_mesh[which])
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
    _unauthenticated(lambda: list(reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
    if which == "verifier":
        stub = verifier_pb2_grpc.VerifierStub(ch)
        _unauthenticated(lambda: stub.Info(verifier_pb2.InfoRequest(), timeout=5))
        _unauthenticated(lambda: stub.Prefill(verifier_pb2.PrefillRequest(session_id="x", prompt=[1, 2]), timeout=5))
        _unauthenticated(lambda: stub.Info(verifier_pb2.InfoRequest(), timeout=5,
                                           metadata=(("authorization", "Bearer nope"),)))
        ok = stub.Info(verifier_pb2.InfoRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert ok.vocab_size > 0
    if which == "drafter":
        stub = drafter_pb2_grpc.DrafterStub(ch)
        _unauthenticated(lambda: stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5))
        opening = drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id="x", prompt=[1, 2]))
        _unauthenticated(lambda: list(stub.Session(iter([opening]), timeout=5)))


def test_mutual_tls(tmp_path, demo_stack):
    pki = make_pki(tmp_path)
    tls = ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"])]
    env = {"SPECMESH_TOKEN": TOKEN}
    v = sh.verifier(*tls, env=env)
    services = [v]
    try:
        v.wait_ready()
        # serve presents the server certificate as its client certificate to the verifier (same CA)
        s = sh.serve([v], [], "--proposer", "prompt_lookup", "--connect-timeout", "20", *tls, env=env)
        services.append(s)
        s.wait_ready()
        client = Client(s.address, token=TOKEN, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"],
                        timeout=60)
        assert client.generate(PROMPT, max_new_tokens=8).token_ids
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
    """--tls-ca trusts a CA without demanding client certificates when --tls-client-auth none (issue 17): serve
    reaches verifiers whose certificates a private CA signed, and clients without certificates reach serve
    (this needed an undocumented GRPC_DEFAULT_SSL_ROOTS_FILE_PATH before)."""
    pki = make_pki(tmp_path)
    cert = ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"])]
    trust = ["--tls-ca", str(pki["ca"]), "--tls-client-auth", "none"]
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
