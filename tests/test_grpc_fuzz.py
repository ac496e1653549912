"""Hypothesis-generated malformed messages against the running services.

Every call must end in OK or a client-error status (INVALID_ARGUMENT, NOT_FOUND,
OUT_OF_RANGE), never UNKNOWN/INTERNAL (an unhandled exception) and never a crash:
afterwards every port is still SERVING and a normal request still works.
"""

from __future__ import annotations

import math

import grpc
import pytest
import service_helpers as sh
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmesh import rpc
from specmesh.client import Client
from specmesh.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(max_examples=120, suppress_health_check=list(HealthCheck), deadline=None)
VOCAB = 4096  # the demo pair's

token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**63), 2**63 - 1))
small_tokens = st.lists(token, max_size=12)
prob = st.one_of(st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True))


@st.composite
def trees(draw) -> common_pb2.TokenTree:
    n = draw(st.integers(0, 10))
    size = st.integers(max(0, n - 1), n + 1)  # mostly consistent lengths, sometimes off by one
    msg = common_pb2.TokenTree(
        tokens=draw(st.lists(token, min_size=draw(size), max_size=n + 1)),
        parents=draw(st.lists(st.one_of(st.integers(-1, n), st.integers(-(2**31), 2**31 - 1)),
                              min_size=draw(size), max_size=n + 1)),
        draft_probs=draw(st.lists(prob, min_size=draw(size), max_size=n + 1)),
        source_names=draw(st.lists(st.text(max_size=5), max_size=2)),
        sources=draw(st.lists(st.integers(-2, 3), max_size=n + 1)),
    )
    if draw(st.booleans()):
        msg.q_cu.extend(draw(st.lists(st.integers(-3, 12), max_size=n + 2)))
        msg.q_ids.extend(draw(st.lists(token, max_size=12)))
        msg.q_probs.extend(draw(st.lists(prob, max_size=12)))
    return msg


sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    top_k=st.integers(-(2**31), 2**31 - 1),
    top_p=st.floats(allow_nan=True, allow_infinity=True),
    seed=st.integers(-(2**63), 2**63 - 1),
    max_new_tokens=st.one_of(st.integers(-3, 6), st.integers(2**20, 2**31 - 1)),
    stop=st.lists(st.text(max_size=4), max_size=2),
    stop_token_ids=st.lists(token, max_size=3),
    ignore_eos=st.booleans(),
)
budget = st.builds(common_pb2.Budget, max_nodes=st.integers(-5, 300), max_depth=st.integers(-5, 40),
                   timeout_ms=st.integers(-10, 50))


def check(call) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details())


def assert_serving(service) -> None:
    response = health_pb2_grpc.HealthStub(sh.channel(service)).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stubs(mesh):
    return (
        verifier_pb2_grpc.VerifierStub(sh.channel(mesh["verifier"])),
        drafter_pb2_grpc.DrafterStub(sh.channel(mesh["drafters"][0])),
        generate_pb2_grpc.GenerateStub(sh.channel(mesh["serve"])),
    )


def test_fuzz_verifier(mesh, stubs):
    verifier = stubs[0]
    live = "fuzz-live"
    verifier.Prefill(verifier_pb2.PrefillRequest(session_id=live, prompt=[1, 2, 3]), timeout=30)

    @FUZZ
    @given(session=st.sampled_from([live, "", "nope"]), tree=trees(), prompt=small_tokens, params=sampling,
           kind=st.sampled_from(["verify", "verify", "batch", "prefill"]))
    def run(session, tree, prompt, params, kind):
        if kind == "verify":
            check(lambda: verifier.Verify(verifier_pb2.VerifyRequest(session_id=session, tree=tree), timeout=30))
        elif kind == "batch":  # each item ends as its own Verify would
            items = [verifier_pb2.VerifyRequest(session_id=s, tree=tree) for s in (session, "fuzz-other")]
            answer = verifier.VerifyBatch(verifier_pb2.VerifyBatchRequest(items=items), timeout=30)
            assert all(o.code == 0 or rpc.status_code(o.code) in ALLOWED for o in answer.items), answer
        else:
            new = f"fuzz-{len(prompt)}-{params.seed}"
            check(lambda: verifier.Prefill(verifier_pb2.PrefillRequest(session_id=new, prompt=prompt,
                                                                       sampling=params), timeout=30))
            # NOT_FOUND when the Prefill was refused: a Release of no session of this caller
            check(lambda: verifier.Release(verifier_pb2.ReleaseRequest(session_id=new), timeout=30))

    try:
        run()
    finally:
        verifier.Release(verifier_pb2.ReleaseRequest(session_id=live), timeout=30)
    assert_serving(mesh["verifier"])


def test_fuzz_drafter(mesh, stubs):
    drafter = stubs[1]
    opening = st.builds(drafter_pb2.OpenSession, session_id=st.text(max_size=8), prompt=small_tokens,
                        sampling=sampling, proposer=st.sampled_from(["", "draft_model", "prompt_lookup_tree", "x"]))
    propose = st.builds(drafter_pb2.Propose, step=st.integers(0, 2**64 - 1), new_tokens=small_tokens, budget=budget)
    message = st.one_of(st.builds(drafter_pb2.DraftRequest, open=opening),
                        st.builds(drafter_pb2.DraftRequest, propose=propose), st.just(drafter_pb2.DraftRequest()))

    @FUZZ
    @given(first=st.builds(drafter_pb2.DraftRequest, open=opening), rest=st.lists(message, max_size=4))
    def run(first, rest):
        check(lambda: list(drafter.Session(iter([first, *rest]), timeout=30)))

    run()
    assert_serving(mesh["drafters"][0])
    assert sh.wait_until(lambda: drafter.Info(drafter_pb2.DrafterInfoRequest(), timeout=5).num_sessions == 0)


def test_fuzz_generate(mesh, stubs):
    generate = stubs[2]
    spec = st.builds(common_pb2.SpecParams, proposer=st.sampled_from(["", "none", "prompt_lookup", "bogus"]),
                     budget=budget)

    @FUZZ
    @given(text=st.one_of(st.none(), st.text(max_size=40)), ids=small_tokens, params=sampling, spec=spec,
           stream=st.booleans())
    def run(text, ids, params, spec, stream):
        request = generate_pb2.GenerateRequest(sampling=params, spec=spec)
        if text is not None:
            request.prompt = text
        elif ids or text is None:
            request.token_ids.ids.extend(ids)
        if stream:
            check(lambda: list(generate.GenerateStream(request, timeout=60)))
        else:
            check(lambda: generate.Generate(request, timeout=60))

    run()
    for service in (mesh["serve"], mesh["verifier"], *mesh["drafters"]):
        assert_serving(service)
    with Client(mesh["serve"].address, timeout=60) as client:
        result = client.generate("def fibonacci(n):", max_new_tokens=8)
    assert len(result.token_ids) == 8 and not math.isnan(result.stats["tau"])
