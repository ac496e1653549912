"""Falcon heads across processes: target features on the wire, a verifier that reports them only to the sessions
that ask, a drafter process that drafts with a head on a --target's tables, and greedy output equal to
autoregressive decoding through `specmesh serve` (sequential and PEARL).

The drafter runs this file as a script (``python tests/test_falcon_grpc.py RECORD drafter ...``): a `specmesh
drafter` whose falcon proposer also writes, after each ``observe``, the target features it received and how many
it holds (``FalconState.known``) to RECORD, so the test sees what crossed the wire.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    "]
MAX_NEW = 24


# ------------------------------------------------------------------------------------ the recording drafter
def _install_recording(record: Path) -> None:
    from drafter_service import falcon
    from drafter_service.proposer import proposer_spec, register

    def factory(**resources):
        proposer = falcon.falcon_proposer(**resources)
        observe = proposer.observe

        def recording(state, feedback):
            observe(state, feedback)
            entry = {"session": state.session_id, "context": len(state.tokens),
                     "features": [[f.start, len(f), type(f.rows).__name__] for f in feedback.features],
                     "known": proposer.scratch(state).known}
            with record.open("a") as out:
                out.write(json.dumps(entry) + "\n")

        proposer.observe = recording
        return proposer

    register(dataclasses.replace(proposer_spec("falcon"), factory=factory))


if __name__ == "__main__":
    from specmesh_app.cli import main

    _install_recording(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))


import service_helpers as sh  # noqa: E402

from drafter_service.falcon_head import random_head, save_head, target_tables  # noqa: E402
from specmesh.client import Client  # noqa: E402
from specmesh.feedback import TargetFeatures  # noqa: E402
from specmesh.rpc import Security  # noqa: E402
from specmesh.sampling import SamplingParams  # noqa: E402
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc  # noqa: E402
from specmesh.wire import (  # noqa: E402
    draft_feedback_from_proto,
    features_from_proto,
    features_to_proto,
    newest_features,
)
from verifier_service.remote import VerifierClient  # noqa: E402


# ------------------------------------------------------------------------------------------------ the wire
@pytest.mark.parametrize("dtype,rel", [("bf16", 2.0**-8), ("fp16", 2.0**-11)])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_features_round_trip(dtype, rel, rows):
    values = np.random.default_rng(rows).standard_normal((rows, 48)).astype(np.float32) * 8
    msg = features_to_proto(TargetFeatures(11, values), dtype)
    assert (msg.start, msg.rows, msg.hidden, len(msg.data)) == (11, rows, 48, rows * 48 * 2)  # 2 bytes a value
    back = features_from_proto(common_pb2.TargetFeatures.FromString(msg.SerializeToString()))
    assert back.start == 11 and back.rows.shape == (rows, 48) and back.rows.dtype == np.float32
    np.testing.assert_allclose(back.rows, values, rtol=rel, atol=0)
    if dtype == "bf16":  # the default; the same rounding as torch's, and exact once rounded
        assert features_to_proto(TargetFeatures(11, values)).data == msg.data
        np.testing.assert_array_equal(back.rows, torch.from_numpy(values).bfloat16().float().numpy())
        assert features_to_proto(back).data == msg.data


def test_malformed_features_are_value_errors():
    good = features_to_proto(TargetFeatures(0, np.ones((3, 4), np.float32)))
    for bad in (dict(data=good.data[:-2]), dict(rows=4), dict(hidden=5), dict(hidden=0), dict(dtype=7)):
        msg = common_pb2.TargetFeatures()
        msg.CopyFrom(good)
        for name, value in bad.items():
            setattr(msg, name, value)
        with pytest.raises(ValueError):
            features_from_proto(msg)
    with pytest.raises(ValueError, match="rows, hidden"):
        features_to_proto(TargetFeatures(0, np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="dtype"):
        features_to_proto(TargetFeatures(0, np.ones((3, 4), np.float32)), "fp8")
    assert draft_feedback_from_proto([], 0, [good]).features[0].rows.shape == (3, 4)


def test_newest_features_fit_the_byte_budget():
    items = [TargetFeatures(0, np.zeros((10, 4), np.float32)), TargetFeatures(10, np.ones((3, 4), np.float32))]
    assert [(f.start, len(f)) for f in newest_features(items, 1 << 20)] == [(0, 10), (10, 3)]
    assert [(f.start, len(f)) for f in newest_features(items, 5 * 4 * 2)] == [(8, 2), (10, 3)]  # newest rows kept
    assert [(f.start, len(f)) for f in newest_features(items, 2 * 4 * 2)] == [(11, 2)]


# ------------------------------------------------------------------------------------------------ the mesh
@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """An untrained head (k=2) for the demo target, saved as `specmesh train-falcon` saves one."""
    from specmesh.models import load_model

    tables = target_tables(load_model(sh.TARGET)).to(torch.float32)
    return save_head(random_head(tables, k=2), tmp_path_factory.mktemp("head") / "demo-falcon",
                     dtype=torch.float32)


@pytest.fixture(scope="module")
def falcon_mesh(head_dir, tmp_path_factory):
    record = tmp_path_factory.mktemp("record") / "observed.jsonl"
    v = sh.verifier("--no-cost-profile")
    d = sh.Service([__file__, str(record), "drafter", "--draft", "none", "--threads", "1", "--target", sh.TARGET,
                    "--proposers", "falcon", "--falcon", str(head_dir)], name="falcon drafter")
    services = [v, d]
    try:
        sh.start_all(v, d)
        s = sh.serve([v], [d], "--proposer", "falcon")
        services.append(s)
        s.wait_ready()
        yield {"verifier": v, "drafter": d, "serve": s, "record": record}
    finally:
        for svc in services:
            svc.stop()


@pytest.fixture(scope="module")
def ar(demo_stack):
    memo = {}

    def get(prompt: str) -> list[int]:
        if prompt not in memo:
            ids = demo_stack.tokenizer.encode(prompt)
            memo[prompt] = demo_stack.engine(None).generate(ids, SamplingParams(max_new_tokens=MAX_NEW)).token_ids
        return memo[prompt]

    return get


@pytest.mark.parametrize("spec", [dict(overlap=False), dict(overlap=True), dict(overlap=True, restart_depth=2)],
                         ids=["sequential", "pearl", "pearl-preverify"])
def test_falcon_over_grpc_greedy_equals_ar(falcon_mesh, ar, spec):
    """An untrained head: trees are rarely accepted, so PEARL restarts every step (restart_depth 0 verifies
    without a tree while the drafter drafts ahead; 2: with a tree of depth 2)."""
    with Client(falcon_mesh["serve"].address, timeout=120) as client:
        for prompt in PROMPTS:
            chunks = list(client.stream(prompt, max_new_tokens=MAX_NEW, proposer="falcon", **spec))
            assert [t for c in chunks for t in c.token_ids] == ar(prompt), prompt
            steps = [c.step for c in chunks if c.step is not None]
            assert not any(s.draft_error for s in steps)  # the falcon drafter drafted every step
            if not spec["overlap"] or spec.get("restart_depth"):  # a tree to wait for on restarts
                assert sum(s.num_proposed for s in steps) > 0
                assert {name for s in steps for name, _ in s.proposed_per_source} == {"falcon"}
            if spec["overlap"]:
                assert sum(s.predraft_nodes for s in steps) > 0  # drafted ahead while the verifier verified


def test_the_drafter_receives_the_features_of_every_committed_position(falcon_mesh, demo_stack):
    record = falcon_mesh["record"]
    # earlier tests' sessions have closed: serve closes a remote drafter session without waiting for it (its last
    # context sync may still be behind a tree drafted ahead), and that sync would be recorded here too
    drafter = drafter_pb2_grpc.DrafterStub(sh.channel(falcon_mesh["drafter"]))
    assert sh.wait_until(lambda: drafter.Info(drafter_pb2.DrafterInfoRequest(), timeout=10).num_sessions == 0,
                         timeout=30)
    record.unlink(missing_ok=True)
    prompt = PROMPTS[0]
    with Client(falcon_mesh["serve"].address, timeout=120) as client:
        assert client.generate(prompt, max_new_tokens=MAX_NEW, proposer="falcon", overlap=False).token_ids
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    assert len({e["session"] for e in entries}) == 1
    received = [f for e in entries for f in e["features"]]
    prompt_len = len(demo_stack.tokenizer.encode(prompt))
    assert received[0][:2] == [0, prompt_len]  # the prompt's, from the prefill
    for (start, n, kind), (next_start, _, _) in zip(received, received[1:], strict=False):
        assert kind == "Tensor" and n >= 1 and next_start == start + n  # then each verification's, contiguous
    known = [e["known"] for e in entries]
    assert known == sorted(known) and known[0] >= prompt_len
    # every committed position but the last has its feature (the last one's comes with the next verification)
    assert known[-1] == received[-1][0] + received[-1][1] >= entries[-1]["context"] - 1


def test_verifier_reports_features_only_to_sessions_that_ask(falcon_mesh, demo_stack):
    client = VerifierClient(falcon_mesh["verifier"].address, Security())
    client.fetch_info(30)
    verifier = client.bind(None)
    prompt = demo_stack.tokenizer.encode(PROMPTS[1])
    sampling = SamplingParams(max_new_tokens=8)
    try:
        asked = verifier.prefill("asked", prompt, sampling, features=True)
        plain = verifier.prefill("plain", prompt, sampling)
        assert plain.features is None and asked.first_token == plain.first_token
        assert asked.features.start == 0 and asked.features.rows.shape == (len(prompt), 256)
        # the target's own features (float64 here), within bf16's rounding
        runner = demo_stack.target_runner
        ids = prompt + [asked.first_token]
        _, truth = runner.forward_batch([runner.new_cache()], np.asarray(ids), np.arange(len(ids)), [len(ids)], [None],
                                        None, torch.arange(len(ids)))
        truth = truth.float().numpy()
        np.testing.assert_allclose(asked.features.rows, truth[: len(prompt)], rtol=2**-8, atol=1e-6)
        from specmesh.tree import TokenTree

        empty = TokenTree.empty()
        step = verifier.verify("asked", empty)
        assert step.features.start == len(prompt) and len(step.features) == 1  # the pending token's row
        np.testing.assert_allclose(step.features.rows[0], truth[len(prompt)], rtol=2**-8, atol=1e-6)
        assert verifier.verify("plain", empty).features is None
    finally:
        verifier.release("asked")
        verifier.release("plain")


def test_one_step_reports_features_to_the_session_that_asked_only(demo_stack):
    """Per session, in one batched forward: the asking session's rows equal a verifier's that reports for all."""
    from specmesh.tree import TokenTree
    from verifier_service.verifier import LocalVerifier

    runner = demo_stack.target_runner
    prompt = demo_stack.tokenizer.encode(PROMPTS[0])
    shared, everyone = LocalVerifier(runner), LocalVerifier(runner, features=True)
    assert shared.prefill("asked", prompt, SamplingParams(max_new_tokens=8), features=True).features is not None
    assert shared.prefill("plain", prompt, SamplingParams(max_new_tokens=8)).features is None
    reference = everyone.prefill("ref", prompt, SamplingParams(max_new_tokens=8))
    tree = TokenTree(np.array([7, 9]), np.array([-1, 0]), np.ones(2))
    asked, plain = shared.verify_batch([("asked", tree), ("plain", tree)])
    assert plain.features is None and asked.batch_sessions == 2
    alone = everyone.verify("ref", tree)
    assert asked.tokens == alone.tokens and asked.features.start == alone.features.start == len(prompt)
    torch.testing.assert_close(asked.features.rows, alone.features.rows)
    assert reference.features.rows.shape[0] == len(prompt)


def test_drafter_refuses_malformed_features(falcon_mesh):
    import grpc

    from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

    stub = drafter_pb2_grpc.DrafterStub(sh.channel(falcon_mesh["drafter"]))
    info = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
    assert list(info.feature_proposers) == ["falcon"] and info.vocab_size == 4096
    good = features_to_proto(TargetFeatures(0, np.zeros((3, 256), np.float32)))
    narrow = features_to_proto(TargetFeatures(0, np.zeros((3, 64), np.float32)))
    short = common_pb2.TargetFeatures(start=0, rows=3, hidden=256, data=good.data[:-1])
    # a row is the feature of a position whose token is in the context (4 tokens here): one 512-byte row at
    # position 65,535 made the drafter allocate every row before it (~190 MB a session)
    far = features_to_proto(TargetFeatures(65535, np.ones((1, 256), np.float32)))
    over = features_to_proto(TargetFeatures(3, np.ones((2, 256), np.float32)))
    nan, inf = (np.zeros((3, 256), np.float32) for _ in range(2))
    nan[1, 7], inf[2, 0] = np.nan, -np.inf
    for bad, match in ((narrow, "hidden size 256"), (short, "bytes"), (far, "past the session's context of 4"),
                       (over, "positions 3..4 are past"), (features_to_proto(TargetFeatures(0, nan)), "NaN or Inf"),
                       (features_to_proto(TargetFeatures(0, inf)), "NaN or Inf")):
        requests = [drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id="x", prompt=[5, 6, 7, 8],
                                                                          proposer="falcon")),
                    drafter_pb2.DraftRequest(propose=drafter_pb2.Propose(step=1, budget=common_pb2.Budget(
                        max_nodes=4, max_depth=2), features=[bad]))]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Session(iter(requests), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()


def test_a_feature_row_far_into_the_context_costs_the_drafter_that_row(falcon_mesh):
    """Features are stored by the rows received: one row at the end of a 65,536-token context (a gap before it
    reads as zeros) cost each session ~190 MB of zeros before; now the context's tokens dominate (~2 MB)."""
    from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

    drafter = falcon_mesh["drafter"]
    stub = drafter_pb2_grpc.DrafterStub(sh.channel(drafter))
    context = 65536  # the drafter's default --max-context
    row = features_to_proto(TargetFeatures(context - 2, np.ones((1, 256), np.float32)))
    before = _rss_mb(drafter.proc.pid)
    streams = []
    try:
        for i in range(2):  # both sessions stay open (their streams too) until the end
            requests = queue.SimpleQueue()
            requests.put(drafter_pb2.DraftRequest(open=drafter_pb2.OpenSession(session_id=f"far-{i}",
                                                                               prompt=[5] * context, proposer="falcon")))
            requests.put(drafter_pb2.DraftRequest(propose=drafter_pb2.Propose(step=1, features=[row])))
            call = stub.Session(iter(requests.get, None), timeout=60)
            streams.append((requests, call))
            assert next(call).step == 1  # the row was observed
        grown = _rss_mb(drafter.proc.pid) - before
    finally:
        for requests, call in streams:
            requests.put(None)
            call.cancel()
    assert grown < 32, f"two sessions grew the drafter by {grown:.0f} MB"
    assert sh.wait_until(lambda: sh.drafter_sessions(drafter) == 0)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


# ------------------------------------------------------------------------------------------- start-up errors
def _drafter_fails(*options: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "specmesh", "drafter", "--draft", "none", "--threads", "1", *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    return proc.stderr


def test_falcon_drafter_needs_its_target(head_dir):
    assert "falcon needs the target model it drafts for: --target DIR" in _drafter_fails("--proposers", "falcon")
    # another target than the head's: the head's fingerprint check refuses it
    message = _drafter_fails("--proposers", "falcon", "--target", sh.DRAFT, "--falcon", str(head_dir))
    assert "made for a target with hidden size 256" in message or "another target" in message
