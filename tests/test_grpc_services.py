"""Disaggregated = embedded = autoregressive, through real servers in separate processes.

The `mesh` fixture runs a verifier, two drafters and `specmesh serve` on 127.0.0.1;
requests go through the client SDK. The reference is the embedded engine on the same
models (float64) in this process.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import service_helpers as sh

from specmesh.client import AsyncClient, Client
from specmesh.sampling import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
PROPOSERS = ["draft_model", "draft_model_tree", "prompt_lookup", "prompt_lookup_tree", "copy", "retrieval", "recycling",
             "jacobi", "lookahead", "fused"]
MAX_NEW = 40


def embedded_ids(stack, proposer, prompt, sampling: SamplingParams, budget=None) -> list[int]:
    engine = stack.engine(proposer, *(budget or ()))  # unset: the proposer's default budget
    return engine.generate(stack.tokenizer.encode(prompt), sampling).token_ids


@pytest.fixture(scope="module")
def client(mesh):
    with Client(mesh["serve"].address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ar(demo_stack):
    memo = {}

    def get(prompt: str, max_new: int = MAX_NEW) -> list[int]:
        if (prompt, max_new) not in memo:
            memo[prompt, max_new] = embedded_ids(demo_stack, None, prompt, SamplingParams(max_new_tokens=max_new))
        return memo[prompt, max_new]

    return get


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_disaggregated_greedy_equals_embedded_and_ar(client, demo_stack, ar, proposer):
    for prompt in PROMPTS:
        remote = client.generate(prompt, max_new_tokens=MAX_NEW, proposer=proposer)
        embedded = embedded_ids(demo_stack, proposer, prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert remote.token_ids == embedded, (proposer, prompt)
        assert remote.token_ids == ar(prompt), (proposer, prompt)
        assert remote.stats["draft_errors"] == 0
        assert remote.stats["steps"] < len(remote.token_ids)  # drafts were accepted: speculation really ran


@pytest.mark.parametrize("spec", [dict(overlap=True), dict(overlap=True, restart_depth=0),
                                  dict(overlap=True, policy="adaptive"), dict(policy="adaptive")],
                         ids=["overlap", "overlap-restart0", "overlap-adaptive", "adaptive"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_overlapped_and_adaptive_greedy_equal_ar(client, ar, proposer, spec):
    """PEARL over gRPC: the drafter process drafts ahead while the verifier process verifies."""
    predrafted = 0
    for prompt in PROMPTS:
        chunks = list(client.stream(prompt, max_new_tokens=MAX_NEW, proposer=proposer, **spec))
        assert [t for c in chunks for t in c.token_ids] == ar(prompt), (proposer, prompt)
        steps = [c.step for c in chunks if c.step is not None]
        assert not any(s.draft_error for s in steps)
        predrafted += sum(s.predrafted for s in steps)
        assert all(s.wait_ms == 0 for s in steps if s.predrafted)
    if spec.get("overlap"):
        assert predrafted > 0  # trees drafted ahead were verified


def test_bad_speculation_options_are_invalid_argument(client):
    for spec in (dict(policy="bogus"), dict(overlap=True, restart_depth=-1)):
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[0], max_new_tokens=4, **spec)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("budget", [(1, 1), (12, 5), (24, 8)])
def test_explicit_budgets_keep_greedy_output(client, ar, budget):
    for proposer in ("draft_model_tree", "prompt_lookup_tree"):
        remote = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer=proposer,
                                 max_nodes=budget[0], max_depth=budget[1])
        assert remote.token_ids == ar(PROMPTS[0])


def test_plain_decoding_through_the_mesh(client, ar):
    remote = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, proposer="none")
    assert remote.token_ids == ar(PROMPTS[1])
    assert remote.stats["tau"] == 1.0


@pytest.mark.parametrize("proposer", ["draft_model", "draft_model_tree", "prompt_lookup"])
def test_seeded_sampling_equals_embedded(client, demo_stack, proposer):
    """Same seed, same draws: the remote path makes exactly the embedded path's random choices, so it
    inherits its distribution (proved by the chi-squared tests of test_sampling_distribution)."""
    params = dict(temperature=0.8, top_p=0.95, seed=1234)
    remote = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer=proposer, **params)
    embedded = embedded_ids(demo_stack, proposer, PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW, **params))
    assert remote.token_ids == embedded


def test_stream_chunks_text_and_stats(client, demo_stack, ar):
    chunks = list(client.stream(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="draft_model"))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == ar(PROMPTS[0])
    assert chunks[0].step is None and len(chunks[0].token_ids) == 1  # the prefill's token
    assert chunks[-1].finish_reason == "length" and not chunks[-1].token_ids
    steps = [c.step for c in chunks if c.step is not None]
    assert all(len(c.token_ids) == c.step.num_accepted + 1 for c in chunks[1:-1])
    assert sum(s.num_accepted + 1 for s in steps) + 1 == len(ids)
    assert all(s.verify_ms > 0 and s.num_proposed >= s.num_accepted for s in steps)
    assert "".join(c.text for c in chunks) == demo_stack.decode(ids)


def test_token_id_prompt_stop_strings_and_eos(client, demo_stack):
    prompt_ids = demo_stack.tokenizer.encode(PROMPTS[2])
    full = client.generate(prompt_ids, max_new_tokens=MAX_NEW)
    stop = full.text[5:9]
    cut = client.generate(prompt_ids, max_new_tokens=MAX_NEW, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = client.generate(prompt_ids, max_new_tokens=MAX_NEW, stop=[stop], include_stop_str_in_output=True)
    assert kept.finish_reason == "stop" and kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_penalties_and_logit_bias_reach_the_remote_verifier(client, demo_stack):
    """The SDK's logit-processor options travel to the verifier replica: the remote output is the embedded one."""
    options = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 4.0})
    sampling = SamplingParams(max_new_tokens=MAX_NEW, presence_penalty=0.5, frequency_penalty=0.5,
                              repetition_penalty=1.2, logit_bias=((7, 4.0),))
    remote = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="draft_model", **options)
    assert remote.token_ids == embedded_ids(demo_stack, "draft_model", PROMPTS[0], sampling)
    assert remote.token_ids != client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="draft_model").token_ids


def test_logprobs_travel_from_the_verifier_replica_to_the_sdk(client, demo_stack):
    """logprobs=k: the replica computes them, the Generate service sends them per chunk and whole; the numbers are
    the embedded stack's."""
    remote = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="draft_model", logprobs=2)
    assert remote.logprobs.token_ids == tuple(remote.token_ids) and len(remote.logprobs.top_ids[0]) == 2
    engine = demo_stack.engine("draft_model")
    local = engine.generate(demo_stack.tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=MAX_NEW, logprobs=2))
    values = [v for e in local.events if e.logprobs is not None for v in e.logprobs.logprobs]
    assert remote.token_ids == local.token_ids and remote.logprobs.logprobs == pytest.approx(values, abs=1e-4)
    chunks = list(client.stream(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="draft_model", logprobs=2))
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_ids] == remote.token_ids
    assert client.generate(PROMPTS[0], max_new_tokens=4).logprobs is None


def test_structured_output_through_the_replicas(client, demo_stack):
    """The SDK's json_schema reaches the verifier replica (it masks with the target's tokenizer) and the drafter
    replica (the grammar proposer drafts the forced tokens); the output is the embedded stack's."""
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}
    remote = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, json_schema=schema)
    local = embedded_ids(demo_stack, None, PROMPTS[0],
                         SamplingParams(max_new_tokens=MAX_NEW, grammar=("json_schema", json.dumps(schema))))
    assert remote.token_ids == local and remote.text.startswith('{"id": ')
    if remote.finish_reason == "stop":
        assert set(json.loads(remote.text)) == {"id", "ok"}
    with pytest.raises(ValueError):
        client.generate(PROMPTS[0], regex="a", lark="start: \"a\"")
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=4, regex="(unclosed")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_async_client_streams_the_same_tokens(mesh, ar):
    async def main():
        async with AsyncClient(mesh["serve"].address, timeout=120) as c:
            assert await c.health() == "SERVING"
            ids = [t async for chunk in c.stream(PROMPTS[1], max_new_tokens=MAX_NEW) for t in chunk.token_ids]
            unary = await c.generate(PROMPTS[1], max_new_tokens=MAX_NEW)
            return ids, unary.token_ids

    streamed, unary = asyncio.run(main())
    assert streamed == unary == ar(PROMPTS[1])


def test_client_cancellation_frees_verifier_and_drafter_sessions(client, mesh):
    stream = client.stream(PROMPTS[0], max_new_tokens=1500, ignore_eos=True, proposer="draft_model")
    next(stream), next(stream)
    assert sh.verifier_sessions(mesh["verifier"]) == 1
    stream.close()  # leaving the loop early cancels the call
    assert sh.wait_until(lambda: sh.verifier_sessions(mesh["verifier"]) == 0)
    assert sh.wait_until(lambda: sum(sh.drafter_sessions(d) for d in mesh["drafters"]) == 0)


@pytest.mark.parametrize("proposer", ["none", "prompt_lookup"])
def test_requests_in_flight_are_data_not_threads(mesh, ar, proposer):
    """`serve` steps every request on one engine core per verifier (orchestrator/remote_loop.py): 40 requests in
    flight at once add no thread each to its process (only its default executor's few, for tokenizing and
    submitting), keep their greedy tokens, and leaving them early frees every verifier session. Drafting on the
    drafter replicas adds none either: every session's stream runs on one shared asyncio loop
    (drafter_service/remote.py), and a proposal out holds no thread while it waits."""
    import os
    import threading

    num, first = 40, 8
    tasks = f"/proc/{mesh['serve'].proc.pid}/task"
    idle = len(os.listdir(tasks))
    started, leave = threading.Barrier(num + 1, timeout=120), threading.Event()
    got: dict[int, list[int]] = {}

    def request(i: int) -> None:
        with Client(mesh["serve"].address, timeout=120) as c:
            stream = c.stream(PROMPTS[i % len(PROMPTS)], max_new_tokens=1500, ignore_eos=True, proposer=proposer)
            tokens = []
            for chunk in stream:
                tokens += chunk.token_ids
                if len(tokens) >= first:
                    break
            got[i] = tokens
            started.wait()  # all in flight now
            leave.wait(120)
            stream.close()

    clients = [threading.Thread(target=request, args=(i,)) for i in range(num)]
    for t in clients:
        t.start()
    started.wait()
    busy = len(os.listdir(tasks))
    leave.set()
    for t in clients:
        t.join(timeout=120)
    assert busy - idle <= min(32, (os.cpu_count() or 1) + 4) + 4 < num, (idle, busy)
    for i, tokens in got.items():
        want = ar(PROMPTS[i % len(PROMPTS)], first)
        assert tokens[: len(want)] == want
    assert len(got) == num
    assert sh.wait_until(lambda: sh.verifier_sessions(mesh["verifier"]) == 0)
    assert sh.wait_until(lambda: sum(sh.drafter_sessions(d) for d in mesh["drafters"]) == 0)


def test_deadline_is_enforced_and_frees_sessions(client, mesh):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=1500, ignore_eos=True, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sh.wait_until(lambda: sh.verifier_sessions(mesh["verifier"]) == 0)
    assert sh.wait_until(lambda: sum(sh.drafter_sessions(d) for d in mesh["drafters"]) == 0)


@pytest.mark.parametrize("kwargs", [
    dict(proposer="no_such_proposer"),
    dict(temperature=-1.0),
    dict(top_p=1.5),
    dict(max_new_tokens=10_000),  # past the target's 2048 positions
    dict(max_nodes=-1, max_depth=3),
])
def test_bad_requests_are_invalid_argument(client, kwargs):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.health() == "SERVING"


def test_out_of_vocabulary_prompt_is_invalid_argument(client):
    for ids in ([1, 2, 10**9], [-3], []):
        with pytest.raises(grpc.RpcError) as err:
            client.generate(ids, max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_during_a_long_prefill_leaves_no_session(client, mesh):
    """The caller gives up while the verifier is still prefilling: the session it then creates
    must be freed at once, not by the idle reaper minutes later."""
    long_prompt = [5 + i % 4000 for i in range(1800)]
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:
            client.generate(long_prompt, max_new_tokens=8, timeout=0.02)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sh.wait_until(lambda: sh.verifier_sessions(mesh["verifier"]) == 0, timeout=10)


def test_oversized_budgets_are_clamped_not_failed(client, ar):
    result = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, proposer="prompt_lookup_tree",
                             max_nodes=100_000, max_depth=8)
    assert result.token_ids == ar(PROMPTS[0])
    assert result.stats["draft_errors"] == 0 and result.stats["steps"] < len(result.token_ids)


def test_drafter_applies_rollbacks_and_rejects_one_past_the_context(mesh):
    """Propose.rollback takes back a hypothesis; more than the context holds is INVALID_ARGUMENT."""
    from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

    stub = drafter_pb2_grpc.DrafterStub(sh.channel(mesh["drafters"][0]))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def session(*proposes):
        msgs = [drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id="rb", prompt=prompt,
                                                                      proposer="prompt_lookup"))]
        msgs += [drafter_pb2.DraftRequest(propose=p) for p in proposes]
        return list(stub.Session(iter(msgs), timeout=30))

    budget = common_pb2.Budget(max_nodes=4, max_depth=4)
    # context 5 6 7 5 6 7 5 6 | +9 (hypothesis) | rollback 1, +7: lookup continues the cycle again
    out = session(drafter_pb2.Propose(step=1, new_tokens=[9], budget=budget),
                  drafter_pb2.Propose(step=2, new_tokens=[7], budget=budget, rollback=1))
    first, second = (list(r.tree.tokens) for r in out)
    assert first == []  # nothing follows a 9 anywhere
    assert second[:2] == [5, 6]  # without the 9 the context is the cycle again
    with pytest.raises(grpc.RpcError) as err:
        session(drafter_pb2.Propose(step=1, new_tokens=[1], budget=budget, rollback=len(prompt)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_drafter_rejects_malformed_feedback(mesh):
    """Feedback feeds state every session shares (adjacency tables, the fleet store): out-of-range
    ids, a committed length past the context, or inconsistent top-k rows are INVALID_ARGUMENT."""
    from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

    stub = drafter_pb2_grpc.DrafterStub(sh.channel(mesh["drafters"][0]))
    budget = common_pb2.Budget(max_nodes=4, max_depth=4)

    def propose(**fields):
        msgs = [drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id="fb", prompt=[5, 6, 7],
                                                                      proposer="recycling")),
                drafter_pb2.DraftRequest(propose=drafter_pb2.Propose(step=1, new_tokens=[8], budget=budget, **fields))]
        return list(stub.Session(iter(msgs), timeout=30))

    good = common_pb2.VerifyFeedback(inputs=[7, 8], k=2, topk=[8, 9, 9, 10], ngram_tokens=[1, 2, 3], ngram_lengths=[3])
    assert len(propose(feedback=[good], committed_len=4)) == 1
    bad = [dict(feedback=[common_pb2.VerifyFeedback(inputs=[7], k=1, topk=[-3])]),
           dict(feedback=[common_pb2.VerifyFeedback(inputs=[7], k=1, topk=[10**9])]),
           dict(feedback=[common_pb2.VerifyFeedback(inputs=[7, 8], k=2, topk=[1, 2, 3])]),
           dict(feedback=[common_pb2.VerifyFeedback(inputs=[7], ngram_tokens=[1, 2], ngram_lengths=[3])]),
           dict(committed_len=5)]
    for fields in bad:
        with pytest.raises(grpc.RpcError) as err:
            propose(**fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields


def test_oversized_prompts_are_refused_before_any_work(client, mesh):
    """Sizes are checked first (issue 17): a 10 MB text prompt is refused by its bytes before it is tokenized
    (it took 18 s and 1.8 GB in serve before the verifier refused it), a token prompt past the context before it
    is forwarded; the verifier never sees either."""
    import time

    sessions_before = sh.verifier_sessions(mesh["verifier"])
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x = 1\n" * (10 * 2**20 // 6), max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in err.value.details()
    assert time.monotonic() - start < 3.0
    with pytest.raises(grpc.RpcError) as err:
        client.generate([1] * 100_000, max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()
    assert sh.verifier_sessions(mesh["verifier"]) == sessions_before


@pytest.mark.parametrize("params", [
    dict(stop=["a"] * 17), dict(stop=["x" * 257]), dict(stop=[""]), dict(stop_token_ids=list(range(257))),
], ids=["17 stops", "long stop", "empty stop", "257 stop ids"])
def test_stop_lists_are_capped(client, params):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=4, **params)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_session_ids_and_drafter_contexts_are_capped(mesh):
    from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    verifier = verifier_pb2_grpc.VerifierStub(sh.channel(mesh["verifier"]))
    for sid in ("", "s" * 129):
        with pytest.raises(grpc.RpcError) as err:
            verifier.Prefill(verifier_pb2.PrefillRequest(session_id=sid, prompt=[1, 2]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    drafter = drafter_pb2_grpc.DrafterStub(sh.channel(mesh["drafters"][0]))
    for opening in (drafter_pb2.OpenSession(session_id="s" * 129, prompt=[1, 2]),
                    drafter_pb2.OpenSession(session_id="x", prompt=[1] * 65537)):  # past --max-context
        with pytest.raises(grpc.RpcError) as err:
            list(drafter.Session(iter([drafter_pb2.DraftRequest(open=opening)]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("which,method,shape", [
    ("verifier", "/specmesh.v1.Verifier/Prefill", "unary"),
    ("serve", "/specmesh.v1.Generate/GenerateStream", "unary_stream"),
    ("drafters", "/specmesh.v1.Drafter/Session", "stream_stream"),
])
def test_undecodable_payloads_are_invalid_argument(mesh, which, method, shape):
    """Bytes that are no protobuf message: INVALID_ARGUMENT with a plain message (was UNKNOWN naming a Python
    exception class)."""
    service = mesh[which][0] if which == "drafters" else mesh[which]
    ch = sh.channel(service)
    garbage = b"\xff\xff\xff\xff"
    with pytest.raises(grpc.RpcError) as err:
        if shape == "unary":
            ch.unary_unary(method)(garbage, timeout=10)
        elif shape == "unary_stream":
            list(ch.unary_stream(method)(garbage, timeout=10))
        else:
            list(ch.stream_stream(method)(iter([garbage]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in err.value.details() and "Error" not in err.value.details()


def test_verify_batch_answers_each_item_as_its_own_verify(mesh):
    """One VerifyBatch is one step: every item is answered as its own Verify would be (the same tokens as a
    second session stepped with Verify, the batch's sessions counted in one forward), a bad item fails alone
    with its Verify's status, and a session named twice is INVALID_ARGUMENT for the call."""
    from specmesh import rpc
    from specmesh.tree import TokenTree
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
    from specmesh.wire import tree_to_proto

    stub = verifier_pb2_grpc.VerifierStub(sh.channel(mesh["verifier"]))
    prompts = {"vb-a": [5, 6, 7, 8], "vb-b": [9, 10, 11], "vb-c": [12, 13, 14, 15, 16]}
    for sid, prompt in prompts.items():  # each twice: the batch's sessions and their Verify-stepped twins
        for name in (sid, sid + "-ref"):
            stub.Prefill(verifier_pb2.PrefillRequest(session_id=name, prompt=prompt), timeout=30)
    empty = tree_to_proto(TokenTree.empty())
    try:
        for _ in range(3):
            items = [verifier_pb2.VerifyRequest(session_id=sid, tree=empty) for sid in prompts]
            answer = stub.VerifyBatch(verifier_pb2.VerifyBatchRequest(items=items), timeout=30)
            assert [o.code for o in answer.items] == [0, 0, 0]
            assert min(o.result.batch_sessions for o in answer.items) >= len(prompts)  # one forward for all
            for sid, outcome in zip(prompts, answer.items, strict=True):
                ref = stub.Verify(verifier_pb2.VerifyRequest(session_id=sid + "-ref", tree=empty), timeout=30)
                assert list(outcome.result.tokens) == list(ref.tokens)

        bad_tree = tree_to_proto(TokenTree.empty())
        bad_tree.tokens.append(5)  # a token without a parent
        items = [verifier_pb2.VerifyRequest(session_id="vb-a", tree=empty),
                 verifier_pb2.VerifyRequest(session_id="vb-ghost", tree=empty),
                 verifier_pb2.VerifyRequest(session_id="vb-b", tree=bad_tree)]
        answer = stub.VerifyBatch(verifier_pb2.VerifyBatchRequest(items=items), timeout=30)
        codes = [rpc.status_code(o.code) for o in answer.items]
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT]
        assert "'vb-ghost'" in answer.items[1].message and "\n" not in answer.items[1].message
        ref = stub.Verify(verifier_pb2.VerifyRequest(session_id="vb-a-ref", tree=empty), timeout=30)
        assert list(answer.items[0].result.tokens) == list(ref.tokens)  # the good item was stepped

        with pytest.raises(grpc.RpcError) as err:
            stub.VerifyBatch(verifier_pb2.VerifyBatchRequest(items=[items[0], items[0]]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        for sid in prompts:
            for name in (sid, sid + "-ref"):
                stub.Release(verifier_pb2.ReleaseRequest(session_id=name), timeout=30)
