"""The engine core (orchestrator/core.py): one thread steps every request.

- Requests submitted at staggered times, each with its own drafter session, produce the AR greedy output of
  their prompt, for every proposer and both runners, sharing forwards (a step verifies several at once).
- A seeded sampled request draws the same tokens alone or in a batch.
- Cancelling a request frees its KV and ends it "aborted"; the others are unaffected.
- A full pool makes a request wait (never fail) and one larger than the pool is refused at submit.
- A drafter that raises is failed over to plain decoding (the output is unchanged) or, strict, fails only its
  own request.
- ``CoreEngine`` (the per-request engine's stream/generate over the core) from many threads at once.
- The core's loop serves a caller's Prefill / Verify calls (the gRPC verifier's sessions) in the same forwards
  as the core's own requests: both get the AR greedy output.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time

import pytest
from spec_helpers import MAX_POSITIONS, greedy, make_prompts, window_for

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import Proposer, make_proposer, proposer_names, proposer_spec
from orchestrator.core import MAX_METHOD_POOLS, EngineCore
from orchestrator.drafter_link import only
from orchestrator.embedded import CoreEngine
from orchestrator.policy import AdaptivePolicy, StaticPolicy, load_aware
from orchestrator.requests import Method, QueueOutput
from specmesh.contract import CapacityError, VerifyCosts
from specmesh.sampling import SamplingParams
from verifier_service.costs import StepCosts
from verifier_service.verifier import LocalVerifier

PROMPTS = make_prompts(8, seed=17, max_len=40)
MAX_NEW = 20


class Collect:
    """A RequestOutput that keeps what the core sends and signals the end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.events = 0
        self.result = self.error = None
        self.done = threading.Event()

    def event(self, event) -> None:
        self.tokens += event.tokens
        self.events += 1

    def finish(self, result, error) -> None:
        self.result, self.error = result, error
        self.done.set()


def method_of(proposer: str | None, draft_runner=None, strict: bool = True, nodes: int = 8,
              overlap: bool = False) -> tuple[Method, int, object]:
    """(method, the verifier's top-k feedback, its lookahead window) for a registered proposer; ``overlap``:
    PEARL with restart depth 0 (the serving default)."""
    if proposer is None:
        return Method(), 0, None
    prop = make_proposer(proposer, draft_runner=draft_runner)
    policy = StaticPolicy(nodes, nodes, restart_depth=0 if overlap else None)
    method = Method(only(LocalDrafter(prop), proposer), policy, prop.feedback_features, strict, overlap)
    return method, prop.feedback_topk, window_for(prop)


def run_all(core: EngineCore, method: Method, prompts, sampling: SamplingParams, stagger: float = 0.03,
            seed: int = 0) -> list[Collect]:
    """Submit every prompt (at random times within ``stagger`` seconds) and wait for all."""
    rng = random.Random(seed)
    outputs = [Collect() for _ in prompts]
    for prompt, out in zip(prompts, outputs, strict=True):
        core.submit(prompt, sampling, method, out)
        time.sleep(rng.random() * stagger / len(prompts))
    for out in outputs:
        assert out.done.wait(120), "a request never finished"
        assert out.error is None, out.error
    return outputs


def assert_idle(core: EngineCore) -> None:
    allocator = core.verifier.allocator
    deadline = time.monotonic() + 5
    while core.num_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.num_sessions == 0 and core.verifier.num_sessions == 0
    assert allocator.num_free == allocator.num_blocks, "KV blocks leaked"


# every proposer on the fast runner, drafting then verifying and overlapped (PEARL); the generic (Hugging Face)
# runner with a few
@pytest.mark.parametrize(("proposer", "backend", "overlap"),
                         [(p, "fast", o) for p in (None, *proposer_names()) for o in (False, True)]
                         + [(p, "hf", False) for p in (None, "prompt_lookup_tree", "draft_model_tree", "fused")])
def test_core_requests_equal_ar(model_sets, ar_reference, proposer, backend, overlap):
    kind = "random" if proposer and proposer_spec(proposer).needs_draft_model else "cyclic"
    ms = model_sets(kind)
    runner = ms.runner("target", backend)
    method, topk, window = method_of(proposer, ms.runner("near", backend), overlap=overlap)
    core = EngineCore(LocalVerifier(runner, feedback_topk=topk, lookahead=window))
    try:
        outputs = run_all(core, method, PROMPTS, greedy(MAX_NEW))
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference(kind, backend, prompt, MAX_NEW), proposer
            assert out.result.finish_reason == "length" and out.result.token_ids == out.tokens
        assert core.stats.max_batch > 1, "no two requests were ever verified in one forward"
        if overlap and proposer in ("prompt_lookup_tree", "copy"):  # cheap drafts, ready before the forward ends
            assert any(s.predrafted and s.num_accepted for o in outputs for s in o.result.stats.steps), \
                "no tree drafted ahead was ever used"
        assert_idle(core)
    finally:
        core.close()



def test_every_running_request_steps_every_step(model_sets, ar_reference):
    """Issue 67: requests of different methods on one core (plain, speculative, overlapped), admitted at staggered
    times and finishing at different steps: every decode step verifies every request decoding (the loop's
    ``stepped_per_running`` is 1), each request's every step is one Verify, and the prefill-only steps (the first
    one at least) are not decode steps, so the batch over decode steps is the requests decoding per step."""
    ms = model_sets("cyclic")
    core = EngineCore(LocalVerifier(ms.runner("target", "fast")))
    methods = [method_of(None)[0], method_of("prompt_lookup_tree")[0],
               method_of("prompt_lookup_tree", overlap=True)[0], method_of("copy", overlap=True)[0]]
    rng = random.Random(3)
    try:
        outputs = [Collect() for _ in PROMPTS]
        for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
            core.submit(prompt, greedy(MAX_NEW), methods[i % len(methods)], out)
            time.sleep(rng.random() * 0.005)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.done.wait(120) and out.error is None, out.error
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        stats = core.stats
        steps_per_request = [len(out.result.stats.steps) for out in outputs]
        assert len(set(steps_per_request)) > 1, "every request took as many steps: no tail to tell apart"
        assert stats.verified == sum(steps_per_request) == stats.decoding  # nobody decoding sat a step out
        assert stats.stepped_per_running == 1.0 and stats.stepped_share == stats.decode_steps
        assert 0 < stats.decode_steps < stats.steps  # a prefill-only step is not a decode step
        assert stats.mean_batch < stats.verified / stats.decode_steps <= len(PROMPTS)
    finally:
        core.close()


def test_the_load_aware_policy_reads_costs_refitted_to_the_cores_steps(model_sets, ar_reference):
    """An engine core given the forward's profiled costs refits them to its own steps (``StepCosts``): the load-aware
    policy of its requests holds that object, every step without a prompt chunk is observed (with its sessions,
    rows and time), the refit is reported where a replica reports its costs, and output is unchanged. The
    requests' steps are pooled per method (``method_steps``: one pool per key, created on first use)."""
    ms = model_sets("cyclic")
    local = LocalVerifier(ms.runner("target", "fast"))
    profile = VerifyCosts(1.0, 0.0, 1e-3)  # far off: a second a step
    core = EngineCore(local, costs=profile)
    try:
        assert isinstance(core.costs, StepCosts) and core.costs is core.scheduler.costs and core.costs.profile is profile
        prop = make_proposer("prompt_lookup_tree")
        pooled = core.method_steps(("prompt_lookup_tree", 8, 8))
        assert core.method_steps(("prompt_lookup_tree", 8, 8)) is pooled is not core.method_steps(("copy", 8, 8))
        policy = load_aware(StaticPolicy(8, 8), core.costs, pooled=pooled)
        assert policy.costs is core.costs and policy.pooled is pooled
        method = Method(only(LocalDrafter(prop), "prompt_lookup_tree"), policy)
        outputs = run_all(core, method, PROMPTS, greedy(MAX_NEW))
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        assert pooled.window.tried > 0 and core.num_running == pooled.running() == 0
        oldest = core.method_steps(("copy", 0, 8))  # the least recently used go past MAX_METHOD_POOLS
        for nodes in range(1, MAX_METHOD_POOLS - 1):  # (with the two above: full)
            core.method_steps(("copy", nodes, 8))
        assert core.method_steps(("prompt_lookup_tree", 8, 8)) is pooled  # used: the most recent again
        core.method_steps(("copy", 99, 8))
        assert core.method_steps(("prompt_lookup_tree", 8, 8)) is pooled
        assert len(core._method_steps) == MAX_METHOD_POOLS
        assert core.method_steps(("copy", 0, 8)) is not oldest  # evicted: made afresh
        chunked = core.stats.steps - core.costs.observed
        assert core.costs.observed >= core.costs.refit_every and 0 < chunked <= len(PROMPTS)  # prefills: not observed
        assert core.costs.seconds(2, 4) < 0.5 * profile.seconds(2, 4)  # a tiny model's step, not a second
        assert (core.costs.base, core.costs.per_row) == (core.costs.current.base, core.costs.current.per_row)
    finally:
        core.close()


def test_shared_engines_of_one_method_pool_their_steps(demo_stack):
    """The embedded stack's engines on its core: one per method (proposer, budget, policy, options), whichever
    thread asks, so its requests share one proposer and drafter (drafted together) and one pool of steps for their
    load-aware policies; another budget has its own; every method runs on the stack's one core."""
    stack = dataclasses.replace(demo_stack, _core=None, _engines={}, _shared_lock=threading.Lock())
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            same = list(pool.map(lambda _: stack.engine("prompt_lookup_tree"), range(2)))
        other = stack.engine("prompt_lookup_tree", max_nodes=4)
        recycling = stack.engine("recycling")
        assert same[0] is same[1] and same[0].method.drafters[0][1]() is not other.method.drafters[0][1]()
        pooled = same[0].method.policy.pooled
        assert pooled is not None and pooled is not other.method.policy.pooled
        assert same[0].core is other.core is recycling.core is stack.core and stack.shared_verifiers() == [stack.core]
        assert recycling.method.feedback_topk > 0 and same[0].method.feedback_topk == 0  # per-row options
    finally:
        stack.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["cpu", "gpu"])
def test_pre_drafts_start_once_the_step_only_waits(model_sets, ar_reference, monkeypatch, asynchronous):
    """PEARL's drafting thread starts on a step's next trees: with a GPU's verifier, once the step is launched
    (``LocalVerifier.launch``: forward, decisions and copy queued) and before the loop waits for it (``finish``),
    not before its host work (the two would take turns at the interpreter lock); with the CPU's, where the forward
    runs in the call, at the top of the step. The output is AR's each time."""
    ms = model_sets("cyclic")
    method, topk, window = method_of("prompt_lookup_tree", overlap=True)
    verifier = LocalVerifier(ms.runner("target", "fast"), feedback_topk=topk, lookahead=window)
    verifier.asynchronous = asynchronous  # where the calls come; the CPU runs the forward either way
    core = EngineCore(verifier)
    events: list[str] = []
    launch_step, finish_step = verifier.launch, verifier.finish
    monkeypatch.setattr(verifier, "launch", lambda *a: (events.append("step"), launch_step(*a))[1])
    monkeypatch.setattr(verifier, "finish", lambda *a: (events.append("finish"), finish_step(*a))[1])
    launch = core.launch
    monkeypatch.setattr(core, "launch", lambda s: (events.append("launch") if s.jobs else None, launch(s))[1])
    try:
        outputs = run_all(core, method, PROMPTS[:3], greedy(MAX_NEW))
        for prompt, out in zip(PROMPTS[:3], outputs, strict=True):
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        assert any(s.predrafted and s.num_accepted for o in outputs for s in o.result.stats.steps)
        launched = [i for i, e in enumerate(events) if e == "launch"]
        assert launched, "nothing was drafted ahead"
        for i in launched:  # before the step (CPU), or between its launch and its finish (GPU)
            if asynchronous:
                assert events[i - 1 : i + 2] == ["step", "launch", "finish"]
            else:
                assert events[i + 1] == "step"
    finally:
        core.close()


@pytest.mark.parametrize("proposer", ["prompt_lookup_tree", "fused", "draft_model_tree"])
def test_adaptive_sequential_steps_equal_ar_and_record_their_accepted_ranks(model_sets, ar_reference, proposer):
    """The adaptive policy's node counts change the trees, never the output; its steps carry the accepted
    nodes' ranks (each path's ranks rising, all within the tree), a static policy's none."""
    kind = "random" if proposer_spec(proposer).needs_draft_model else "cyclic"
    ms = model_sets(kind)
    prop = make_proposer(proposer, draft_runner=ms.runner("near", "fast"))
    core = EngineCore(LocalVerifier(ms.runner("target", "fast"), feedback_topk=prop.feedback_topk,
                                    lookahead=window_for(prop)))
    adaptive = Method(only(LocalDrafter(prop), proposer), AdaptivePolicy(16, 8), prop.feedback_features)
    try:
        outputs = run_all(core, adaptive, PROMPTS, greedy(MAX_NEW))
        steps = [s for out in outputs for s in out.result.stats.steps]
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference(kind, "fast", prompt, MAX_NEW)
        assert all(s.accepted_ranks is not None and len(s.accepted_ranks) == s.num_accepted for s in steps)
        assert all(list(s.accepted_ranks) == sorted(set(s.accepted_ranks)) and max(s.accepted_ranks) < s.num_proposed
                   for s in steps if s.num_accepted)
        if proposer != "draft_model_tree":  # whether a draft model's levels pay here depends on this machine's timing
            assert sum(s.num_accepted for s in steps) > 0
        static, _, _ = method_of(proposer, ms.runner("near", "fast"))
        out = run_all(core, static, PROMPTS[:2], greedy(MAX_NEW))[0]
        assert all(s.accepted_ranks is None for s in out.result.stats.steps)
        assert_idle(core)
    finally:
        core.close()


def test_chunked_prefills_beside_decoding_equal_ar(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    prompts = make_prompts(6, seed=11, min_len=60, max_len=200)
    method, _, _ = method_of("prompt_lookup_tree")
    core = EngineCore(LocalVerifier(runner, prefill_chunk=16), max_batch_tokens=48)
    try:
        outputs = run_all(core, method, prompts, greedy(MAX_NEW))
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW)
        assert core.stats.prefill_chunks > len(prompts)  # prompts took several chunks
        assert_idle(core)
    finally:
        core.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("proposer", [None, "prompt_lookup_tree", "draft_model_tree"])
def test_a_seeded_sampled_request_is_the_same_alone_or_batched(model_sets, proposer, overlap):
    ms = model_sets("random")
    runner = ms.runner("target", "fast")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=MAX_NEW, seed=123, ignore_eos=True)
    others = dataclasses.replace(sampling, seed=None)
    core = EngineCore(LocalVerifier(runner))
    try:
        def fresh() -> Method:  # a fresh drafter: the same state as when alone
            return method_of(proposer, ms.runner("near", "fast"), overlap=overlap)[0]

        alone = run_all(core, fresh(), [PROMPTS[0]], sampling)[0].tokens
        method = fresh()
        batch = [Collect() for _ in PROMPTS]
        for i, (prompt, out) in enumerate(zip(PROMPTS, batch, strict=True)):
            core.submit(prompt, sampling if i == 3 else others, method, out)
        for out in batch:
            assert out.done.wait(60) and out.error is None
        assert core.stats.max_batch > 1
        seeded = run_all(core, fresh(), [PROMPTS[0]], sampling)[0].tokens
        assert alone == seeded  # reproducible
        batched = [c.tokens for i, c in enumerate(batch) if i == 3][0]
        alone_3 = run_all(core, fresh(), [PROMPTS[3]], sampling)[0].tokens
        assert batched == alone_3
    finally:
        core.close()


def test_cancel_ends_a_request_and_frees_its_blocks(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    core = EngineCore(LocalVerifier(runner))
    try:
        long = Collect()
        long_id = core.submit(PROMPTS[0], greedy(400), Method(), long)
        short = run_all(core, Method(), [PROMPTS[1]], greedy(MAX_NEW))[0]
        assert short.tokens == ar_reference("cyclic", "fast", PROMPTS[1], MAX_NEW)
        core.cancel(long_id)
        assert long.done.wait(10) and long.error is None
        assert long.result.finish_reason == "aborted" and 0 < len(long.tokens) < 400
        core.cancel("no-such-request")  # unknown ids are ignored
        assert_idle(core)
    finally:
        core.close()


def test_a_full_pool_makes_requests_wait_and_refuses_what_never_fits(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    # admission takes a prompt's blocks: two of these fit, a third waits (distinct: nothing in the prefix cache)
    prompts = [(PROMPTS[i] * 20)[:80] for i in range(6)]
    per_request = len(prompts[0]) + MAX_NEW + 1 + 8  # a request's largest footprint (max_tree_nodes=8)
    local = LocalVerifier(runner, max_tree_nodes=8, kv_cache_gb=2 * per_request * runner.kv_bytes_per_token / 2**30,
                          block_size=1)
    assert local.info.max_positions == 2 * per_request - 1 - 8  # the context served: what one request can hold
    core = EngineCore(local, max_waiting=3)
    try:
        with pytest.raises(ValueError, match="raise --kv-cache-gb"):  # past what the pool could ever hold for it
            core.submit(list(range(3)) * per_request, greedy(MAX_NEW), Method(), Collect())
        outputs = [Collect() for _ in range(5)]
        for prompt, out in zip(prompts, outputs, strict=False):  # two prompts (and the watermark) fit at a time
            core.submit(prompt, greedy(MAX_NEW), Method(), out)
        with pytest.raises(CapacityError, match="already wait"):  # a sixth would wait behind three: refused
            core.submit(prompts[5], greedy(MAX_NEW), Method(), Collect())
        for out in outputs:
            assert out.done.wait(120) and out.error is None, out.error
        assert all(o.tokens == ar_reference("cyclic", "fast", p, MAX_NEW) for p, o in zip(prompts, outputs,
                                                                                         strict=False))
        assert core.stats.max_batch <= 2
        assert_idle(core)
    finally:
        core.close()


class Exploding(Proposer):
    """Drafts a correct chain twice, then raises."""

    name = "exploding"

    def __init__(self) -> None:
        self.inner, self.calls = make_proposer("prompt_lookup"), 0

    def propose(self, state, budget):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("drafter crashed")
        return self.inner.propose(state, budget)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_drafter_falls_back_or_fails_only_its_request(model_sets, ar_reference, strict):
    runner = model_sets("cyclic").runner("target", "fast")
    core = EngineCore(LocalVerifier(runner))
    try:
        bad = Method(only(LocalDrafter(Exploding()), "exploding"), StaticPolicy(8, 8), strict=strict)
        good, _, _ = method_of("prompt_lookup_tree")
        failing, healthy = Collect(), Collect()
        core.submit(PROMPTS[0], greedy(MAX_NEW), bad, failing)
        core.submit(PROMPTS[1], greedy(MAX_NEW), good, healthy)
        assert failing.done.wait(60) and healthy.done.wait(60)
        assert healthy.error is None and healthy.tokens == ar_reference("cyclic", "fast", PROMPTS[1], MAX_NEW)
        if strict:
            assert isinstance(failing.error, RuntimeError) and failing.result.finish_reason == "error"
        else:
            assert failing.error is None and failing.tokens == ar_reference("cyclic", "fast", PROMPTS[0], MAX_NEW)
            errors = [s.draft_error for s in failing.result.stats.steps if s.draft_error]
            assert errors and "drafter crashed" in errors[0]
        assert_idle(core)
    finally:
        core.close()


def test_stop_tokens_end_a_request_where_plain_decoding_would(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    reference = ar_reference("cyclic", "fast", PROMPTS[4], MAX_NEW)
    stop = reference[7]
    method, _, _ = method_of("prompt_lookup_tree")
    core = EngineCore(LocalVerifier(runner))
    try:
        out = run_all(core, method, [PROMPTS[4]], greedy(MAX_NEW, stop_token_ids=(stop,)))[0]
        assert out.tokens == reference[: reference.index(stop) + 1] and out.result.finish_reason == "stop"
        assert_idle(core)
    finally:
        core.close()


def test_core_engine_streams_from_many_threads_and_closing_cancels(model_sets, ar_reference):
    runner = model_sets("cyclic").runner("target", "fast")
    core = EngineCore(LocalVerifier(runner))
    try:
        method, _, _ = method_of("prompt_lookup_tree")
        engine = CoreEngine(core, method)
        results: dict[int, list[int]] = {}

        def work(i: int) -> None:
            results[i] = engine.generate(PROMPTS[i], greedy(MAX_NEW)).token_ids

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(results[i] == ar_reference("cyclic", "fast", p, MAX_NEW) for i, p in enumerate(PROMPTS))
        stream = engine.stream(PROMPTS[0], greedy(MAX_POSITIONS - len(PROMPTS[0])))
        next(stream)
        stream.close()  # the consumer went away: the request is cancelled and its blocks come back
        assert_idle(core)
    finally:
        core.close()


def test_a_closed_core_refuses_and_ends_what_it_held(model_sets):
    runner = model_sets("cyclic").runner("target", "fast")
    core = EngineCore(LocalVerifier(runner))
    out = QueueOutput()
    core.submit(PROMPTS[0], greedy(400), Method(), out)
    core.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(out.events())
    with pytest.raises(RuntimeError, match="closed"):
        core.submit(PROMPTS[0], greedy(4), Method(), Collect())


def test_propose_many_isolates_a_bad_call_and_equals_one_call_each(model_sets):
    """``LocalDrafter.propose_many``: every call's context edit applies; an unknown session fails alone; the trees
    equal one ``propose`` per session."""
    from specmesh.contract import Budget, DraftCall

    runner = model_sets("random").runner("near", "fast")
    batched, single = LocalDrafter(make_proposer("draft_model", draft_runner=runner)), \
        LocalDrafter(make_proposer("draft_model", draft_runner=runner))
    for drafter in (batched, single):
        for i, prompt in enumerate(PROMPTS[:3]):
            drafter.open(f"s{i}", prompt, greedy(8))
    calls = [DraftCall("s0", [5, 6], Budget(4, 4)), DraftCall("nope", [1], Budget(4, 4)),
             DraftCall("s1", [], Budget(0, 0)), DraftCall("s2", [7], Budget(3, 3))]
    got = batched.propose_many(calls)
    assert isinstance(got[1], KeyError) and got[2].num_nodes == 0
    for call, tree in zip(calls, got, strict=True):
        if call.session_id != "nope":
            want = single.propose(call.session_id, call.new_tokens, call.budget, call.rollback)
            assert tree.tokens.tolist() == want.tokens.tolist()
            assert batched.context_length(call.session_id) == single.context_length(call.session_id)


@pytest.mark.parametrize("proposer", [p for p in proposer_names() if p != "falcon"])  # falcon drafts on features
def test_every_proposers_batch_equals_one_session_at_a_time(model_sets, proposer):
    """``Proposer.propose_batch`` (what the engine core and the drafter server call) drafts exactly the trees of one
    ``propose`` per session, for every registered proposer (a subclass must not inherit a batched path that drafts
    differently: MJSD's beams are not the draft model's chains)."""
    from drafter_service.proposer import DraftSessionState
    from specmesh.contract import Budget

    runner = model_sets("random").runner("near", "fast")
    one, many = make_proposer(proposer, draft_runner=runner), make_proposer(proposer, draft_runner=runner)
    prompts = make_prompts(4, seed=31, min_len=8, max_len=40)
    alone = [DraftSessionState(f"s{i}", list(p) * 2, greedy(8)) for i, p in enumerate(prompts)]
    together = [DraftSessionState(f"s{i}", list(p) * 2, greedy(8)) for i, p in enumerate(prompts)]
    for state in alone:
        one.prepare(state)
    for state in together:
        many.prepare(state)
    budgets = [Budget(8, 4), Budget(4, 4), Budget(6, 3), Budget(2, 2)]
    for _ in range(2):
        want = [one.propose(s, b) for s, b in zip(alone, budgets, strict=True)]
        got = many.propose_batch(together, budgets)
        for w, g in zip(want, got, strict=True):
            assert g.tokens.tolist() == w.tokens.tolist() and g.parents.tolist() == w.parents.tolist(), proposer
        for a, b, tree in zip(alone, together, want, strict=True):
            step = tree.tokens[:1].tolist() + [7]
            a.tokens += step
            b.tokens += step
