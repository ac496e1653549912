"""Retrieval drafting over n-gram stores: fleet learning counts every committed position once,
Jacobi harvests reach the store, Redis going away mid-request fails no request, two drafter
processes share what the fleet learned, and `specmesh ingest` fills both kinds of store.
Real redis-server on a free port."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import service_helpers as sh
from redis_helpers import RedisServer
from spec_helpers import ForwardingProposer, engine_for, greedy, make_prompts

from drafter_service.ngram_store import (
    FallbackNGramStore,
    MemoryNGramStore,
    RedisNGramStore,
    StoreConfig,
    StoreLearner,
    tokenizer_fingerprint,
)
from drafter_service.proposer import DraftSessionState
from drafter_service.remote import DrafterClient
from drafter_service.retrieval import RetrievalProposer
from drafter_service.tree_builders import weighted_paths_tree
from specmesh import rpc
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback, VerifyFeedback
from specmesh.models import load_tokenizer
from specmesh.sampling import SamplingParams
from specmesh_app import cli
from specmesh_app.local_mesh import LocalRedis

PROMPTS = make_prompts(4, seed=11)
MAX_NEW = 40


@pytest.fixture(scope="module")
def redis_server():
    srv = RedisServer()
    yield srv
    srv.stop()


def test_weighted_paths_tree_merges_by_weight():
    tree = weighted_paths_tree([((1, 2, 3), 3), ((1, 2, 4), 1), ((5,), 1)], max_nodes=4, max_depth=3)
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)): float(tree.draft_probs[i]) for i in range(4)}
    # weights: (1) 4, (1 2) 4, (1 2 3) 3, then (5) 1 and (1 2 4) 1 tie: the shallower wins
    assert paths == {(1,): 0.8, (1, 2): 1.0, (1, 2, 3): 0.75, (5,): 0.2}
    assert weighted_paths_tree([], 4, 4).num_nodes == 0


@pytest.mark.parametrize("learn", ["outputs", "all"])
def test_fleet_learning_counts_every_committed_position_once(model_sets, ar_reference, learn):
    """After each request, the store holds exactly the n-grams of what was committed (and of the
    prompt with learn=all), however the steps and drafted-ahead rollbacks cut the sequence."""
    target = model_sets("cyclic").runner("target", "fast")
    config = StoreConfig(min_n=1, max_n=3, span=3, top_n=64)
    store = MemoryNGramStore(config)
    learner = StoreLearner(store)
    engine = engine_for(target, RetrievalProposer(store, learner, learn=learn), 6, 4)
    engine.overlap = True
    expected = MemoryNGramStore(config)
    for prompt in PROMPTS:
        out = engine.generate(prompt, greedy(MAX_NEW)).token_ids
        assert out == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        expected.add(list(prompt) + out, start=0 if learn == "all" else len(prompt))
        assert learner.flush()
        assert store._table == expected._table


def test_jacobi_ngrams_from_the_verifier_reach_the_store():
    store = MemoryNGramStore(StoreConfig(min_n=2, max_n=3, span=4))
    learner = StoreLearner(store)
    prop = RetrievalProposer(store, learner)
    state = DraftSessionState("s", [1, 2, 3], SamplingParams())
    prop.prepare(state)
    fb = VerifyFeedback.of([3], np.zeros((1, 0)), ngrams=[(7, 8, 9, 10)])
    prop.observe(state, DraftFeedback(3, (fb,)))
    assert learner.flush()
    state.tokens += [7, 8]
    assert prop.propose(state, Budget(4, 4)).tokens.tolist() == [9, 10]


class _StopsRedisMidRequest(ForwardingProposer):
    """Retrieval that kills Redis on its 5th proposal: the rest of the request runs on memory."""

    def __init__(self, inner: RetrievalProposer, server: LocalRedis) -> None:
        super().__init__(inner)
        self.server, self.calls = server, 0

    def propose(self, state, budget):
        self.calls += 1
        if self.calls == 5:
            self.server.stop()
        return self.inner.propose(state, budget)


def test_redis_stopped_mid_request_fails_no_request(model_sets, ar_reference):
    srv = RedisServer()
    try:
        config = StoreConfig(min_n=1, max_n=3, span=4)
        primary = RedisNGramStore.from_url(srv.url, config, "t")
        store = FallbackNGramStore(primary, MemoryNGramStore(config, "t"), retry_after_s=60)
        inner = RetrievalProposer(store, StoreLearner(store))
        target = model_sets("cyclic").runner("target", "fast")
        engine = engine_for(target, _StopsRedisMidRequest(inner, srv), 8, 6)
        engine.overlap = True
        accepted = 0
        for prompt in PROMPTS:
            res = engine.generate(prompt, greedy(MAX_NEW))
            assert res.token_ids == ar_reference("cyclic", "fast", prompt, MAX_NEW)
            assert res.stats.num_draft_errors == 0
            accepted += sum(s.num_accepted for s in res.stats.steps)
        assert store.failures >= 1  # Redis did go away mid-run
        assert accepted > 0  # and drafting went on from memory
    finally:
        srv.stop()


def _drafter_process(url: str) -> sh.Service:
    return sh.Service(["-m", "specmesh", "drafter", "--draft", "none", "--tokenizer", sh.TARGET, "--threads", "1",
                       "--proposers", "retrieval", "--ngram-store", url], None, "drafter")


def test_two_drafter_processes_share_what_the_fleet_learned(redis_server):
    """A session on drafter A commits a sequence; drafter B, another process on the same Redis, then
    drafts that sequence's continuation for a context it has never seen."""
    a, b = _drafter_process(redis_server.url), _drafter_process(redis_server.url)
    try:
        sh.start_all(a, b)
        rng = np.random.default_rng(3)
        prompt = rng.integers(100, 4000, 6).tolist()
        output = rng.integers(100, 4000, 30).tolist()
        sampling = SamplingParams(max_new_tokens=64)
        ca, cb = DrafterClient(a.address, rpc.Security()), DrafterClient(b.address, rpc.Security())
        try:
            da = ca.drafter("retrieval")
            da.open("s1", prompt, sampling)
            for i in range(0, len(output), 5):  # committed a few tokens at a time, as steps do
                done = len(prompt) + i + 5
                da.propose("s1", output[i : i + 5], Budget(4, 4), 0, DraftFeedback(done))
            da.close("s1")
            db = cb.drafter("retrieval")
            seen = prompt + output[:12]
            db.open("s2", [1, 2, 3] + output[8:12], sampling)

            def proposal():
                return db.propose("s2", [], Budget(8, 8)).tokens.tolist()

            assert sh.wait_until(lambda: proposal() == output[12:20], timeout=20), (proposal(), output[12:20], seen)
            db.close("s2")
        finally:
            ca.close()
            cb.close()
    finally:
        a.stop()
        b.stop()


def test_the_last_proposal_before_a_close_reaches_the_drafter(redis_server):
    """A link closes its drafter session right after the context sync (a zero budget with the session's last tokens,
    not waited for: `DrafterLink.close(wait=False)`). The stream half-closes and is cancelled only once that
    proposal is answered or past its deadline, so the fleet store learns the session's last tokens too."""
    a = _drafter_process(redis_server.url)
    try:
        sh.start_all(a)
        rng = np.random.default_rng(4)
        prompt, output = rng.integers(100, 4000, 6).tolist(), rng.integers(100, 4000, 40).tolist()
        client = DrafterClient(a.address, rpc.Security())
        try:
            first = client.drafter("retrieval")
            first.open("s1", prompt, SamplingParams(max_new_tokens=64))
            first.propose("s1", output[:20], Budget(4, 4), 0, DraftFeedback(len(prompt) + 20))
            sync = first.propose_async("s1", output[20:], Budget(0, 0, deadline=time.monotonic() + 5), 0,
                                       DraftFeedback(len(prompt) + len(output)))
            first.close("s1")  # at once, as a background link does
            assert sync.result(timeout=10).num_nodes == 0
            second = client.drafter("retrieval")
            second.open("s2", [1, 2, 3] + output[20:26], SamplingParams(max_new_tokens=64))  # only the sync's

            def proposal():
                return second.propose("s2", [], Budget(6, 6)).tokens.tolist()

            assert sh.wait_until(lambda: proposal() == output[26:32], timeout=20), (proposal(), output[26:32])
            second.close("s2")
        finally:
            client.close()
    finally:
        a.stop()


def test_ingest_fills_a_snapshot_and_redis(tmp_path, redis_server):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    (corpus / "skip.bin").write_text("not taken: no matching glob")
    out = tmp_path / "store.ngrams"
    base = [sys.executable, "-m", "specmesh", "ingest", str(corpus), "--tokenizer", sh.TARGET, "--quiet"]
    subprocess.run([*base, "--out", str(out)], check=True, timeout=120)
    tokenizer = load_tokenizer(sh.TARGET)
    namespace = tokenizer_fingerprint(tokenizer.get_vocab())
    ids = tokenizer("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", add_special_tokens=False).input_ids
    snapshot = MemoryNGramStore.load(out)
    assert snapshot.namespace == namespace and len(snapshot) > 0
    found = snapshot.lookup(ids[:10], 4)
    assert found and list(found[0][0]) == ids[10 : 10 + snapshot.config.span]

    subprocess.run([*base, "--store", redis_server.url], check=True, timeout=120)
    redis_store = RedisNGramStore.from_url(redis_server.url, StoreConfig(), namespace)
    assert redis_store.lookup(ids[:10], 4) == snapshot.lookup(ids[:10], 4)

    bad = subprocess.run([sys.executable, "-m", "specmesh", "ingest", str(tmp_path / "missing"), "--tokenizer",
                          sh.TARGET, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no such file" in bad.stderr and "Traceback" not in bad.stderr


# the CLI with every write past a file size limit failing (RLIMIT_FSIZE: EFBIG, SIGXFSZ ignored), as on a
# disk that fills up part way through a file; the limit is the first argument
FULL_DISK = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "limit = int(sys.argv.pop(1)); resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
             "runpy.run_module('specmesh', run_name='__main__', alter_sys=True)")


def test_ingest_append_on_a_full_disk_keeps_the_old_snapshot(tmp_path):
    tokenizer = load_tokenizer(sh.TARGET)
    old = MemoryNGramStore(StoreConfig(), tokenizer_fingerprint(tokenizer.get_vocab()))
    old.add(np.random.default_rng(0).integers(0, len(tokenizer), 3000).tolist())
    out = tmp_path / "store.ngrams"
    old.save(out)
    before = out.read_bytes()
    corpus = tmp_path / "a.py"
    corpus.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")

    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(len(before) // 2), "ingest", str(corpus),
                          "--tokenizer", sh.TARGET, "--quiet", "--out", str(out), "--append"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"specmesh ingest: --out {out}: File too large")
    assert out.read_bytes() == before  # not truncated, not half rewritten: the old snapshot as it was
    assert MemoryNGramStore.load(out)._table == old._table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "store.ngrams"]  # no temporary left


@pytest.mark.parametrize("where", ["a_file/store.ngrams", "a_dir", "missing/store.ngrams"])
def test_ingest_refuses_an_unwritable_out_before_tokenizing(tmp_path, where):
    (tmp_path / "a_file").write_text("def f(): pass\n")
    (tmp_path / "a_dir").mkdir()
    out = tmp_path / where
    # no tokenizer there: refusing the path first is what keeps this from failing on the tokenizer
    with pytest.raises(SystemExit, match=f"^specmesh ingest: --out {out}: "):
        cli.main(["ingest", str(tmp_path / "a_file"), "--out", str(out), "--tokenizer", str(tmp_path / "none")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"] and not any((tmp_path / "a_dir").iterdir())
