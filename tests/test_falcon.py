"""The Falcon proposer: head save/load, target features from the runners and the verifier, per-session head
state exact under rollbacks, greedy == AR (sequential and PEARL), lossless sampling through the Falcon tree,
and `specmesh train-falcon` on a tiny model."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from spec_helpers import make_prompts, make_runner, naive_greedy, tiny_llama
from test_sampling_distribution import E2E_PROMPT, E2E_SAMPLES, P_PASS, WARPS, chisquare_p, exact_pair_law

from drafter_service.drafter import LocalDrafter
from drafter_service.falcon import FalconProposer, FalconState, falcon_proposer
from drafter_service.falcon_head import load_head, random_head, save_head, target_tables
from orchestrator.drafter_link import only
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams
from verifier_service.verifier import LocalVerifier

PROMPTS = make_prompts(8, seed=3)
MAX_NEW = 20


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=11)


@pytest.fixture(scope="module")
def runners(target):
    return {backend: make_runner(target, backend) for backend in ("hf", "fast")}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@torch.no_grad()
def hf_features(model, ids: list[int]) -> torch.Tensor:
    """The base model's last hidden state (after the final norm): what the LM head reads."""
    return model.model(torch.tensor([ids])).last_hidden_state[0]


# ------------------------------------------------------------------------------------------------- the head
def test_head_save_load_and_target_check(tmp_path, runners):
    tables = target_tables(runners["fast"]).to(torch.float32)
    head = random_head(tables, k=3)
    save_head(head, tmp_path / "h-falcon", dtype=torch.float32)
    loaded = load_head(tmp_path / "h-falcon", tables)
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert all("embed" not in n and "lm_head" not in n for n in loaded.state_dict())  # only the head's own
    other = target_tables(tiny_llama(seed=12)).to(torch.float32)
    with pytest.raises(ValueError, match="another target"):
        load_head(tmp_path / "h-falcon", other)
    smaller = target_tables(tiny_llama(seed=12, hidden=32, intermediate=64)).to(torch.float32)
    with pytest.raises(ValueError, match="hidden size 64"):
        load_head(tmp_path / "h-falcon", smaller)
    with pytest.raises(ValueError, match="not a Falcon head"):
        load_head(tmp_path, tables)
    with pytest.raises(ValueError, match="k and draft_vocab come from"):
        falcon_proposer(target_runner=runners["fast"], head=str(tmp_path / "h-falcon"), k=2)


def test_reduced_vocabulary_head_saves_drafts_and_ships_exact_q(tmp_path, runners):
    """A head with a draft vocabulary of N tokens: its ids travel with the weights (int64, not cast to the
    head's dtype), its logits cover N tokens, every drafted token and every shipped q id is one of them, and
    the shipped q is a distribution (the verifier treats the rest as q = 0)."""
    tables = target_tables(runners["fast"]).to(torch.float32)
    head = random_head(tables, k=2, draft_vocab=20, seed=4)
    ids = head.vocab_ids.tolist()
    assert len(set(ids)) == 20 and head.logits(torch.randn(3, tables.hidden_size)).shape == (3, 20)
    assert head.to_target(torch.tensor([0, 19])).tolist() == [ids[0], ids[19]]
    outside = next(t for t in range(128) if t not in ids)
    assert head.to_draft(torch.tensor([ids[5], outside])).tolist() == [5, -1]
    save_head(head, tmp_path / "v-falcon")  # bf16 weights: the ids stay exact
    loaded = load_head(tmp_path / "v-falcon", tables)
    assert loaded.config.draft_vocab == 20 and loaded.vocab_ids.dtype == torch.int64
    assert loaded.vocab_ids.tolist() == ids
    torch.testing.assert_close(loaded.logits(torch.ones(1, tables.hidden_size)),
                               F.linear(torch.ones(1, tables.hidden_size), tables.lm_head[loaded.vocab_ids].to(
                                   torch.bfloat16).float()), rtol=0.05, atol=0.05)
    other = random_head(tables, k=2, draft_vocab=20, seed=5)
    x = torch.randn(2, tables.hidden_size)
    with torch.inference_mode():  # a drafter may load a head there: the rows gathered follow the ids loaded
        before = other.logits(x)
        other.load_state_dict(head.state_dict())
        torch.testing.assert_close(other.logits(x), head.logits(x))
        assert not torch.equal(before, other.logits(x))
    with pytest.raises(ValueError, match="distinct"):
        random_head(tables, k=2, draft_vocab=3).set_vocab([1, 1, 2])
    with pytest.raises(ValueError, match="draft_vocab must be"):
        random_head(tables, k=2, draft_vocab=129)
    with pytest.raises(ValueError, match="draft_vocab come from"):
        falcon_proposer(target_runner=runners["fast"], head=str(tmp_path / "v-falcon"), draft_vocab=8)
    drafter = LocalDrafter(FalconProposer(loaded))
    for sp in (greedy(8), SamplingParams(temperature=1.5, top_p=0.99, max_new_tokens=8, seed=2)):
        for prompt in PROMPTS[:3]:
            drafter.open("s", prompt, sp)
            tree = drafter.propose("s", [], Budget(24, 6)).validate(128, 24, 6)
            assert tree.num_nodes > 1 and set(tree.tokens.tolist()) <= set(ids)
            if not sp.greedy:
                assert set(tree.q_ids.tolist()) <= set(ids)
                sums = np.add.reduceat(tree.q_probs, tree.q_cu[:-1])
                np.testing.assert_allclose(sums, 1.0, rtol=1e-9)
            drafter.close("s")


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    from specmesh_app.train_falcon import draft_vocabulary

    ids = torch.tensor([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9, 1, 7]])
    assert draft_vocabulary(ids, 12, 2).tolist() == [5, 9]  # 9 (5 times), 5 (3 times)
    assert draft_vocabulary(ids, 12, 3).tolist() == [2, 5, 9]
    assert draft_vocabulary(ids, 12, 4).tolist() == [1, 2, 5, 9]  # 1 and 7 tie (once each): the lower id
    filled = draft_vocabulary(ids, 12, 7).tolist()
    assert filled == [0, 1, 2, 3, 5, 7, 9]  # never-seen tokens fill up from the lowest id


# ----------------------------------------------------------------------------------------- target features
@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_runner_features_are_the_final_norm_output(target, runners, backend):
    runner, ids = runners[backend], PROMPTS[0]
    cache = runner.new_cache()
    logits, feats = runner.forward_batch([cache], ids, np.arange(len(ids)), [len(ids)], [None], None,
                                         torch.arange(len(ids)))
    torch.testing.assert_close(feats, hf_features(target, ids), rtol=1e-9, atol=1e-9)
    plain = runner.forward_batch([runner.new_cache()], ids, np.arange(len(ids)), [len(ids)], [None])
    torch.testing.assert_close(logits, plain)  # the features change nothing else


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_verifier_reports_features_of_committed_rows(target, runners, backend):
    verifier = LocalVerifier(runners[backend], features=True)
    prompt = PROMPTS[1]
    expected = naive_greedy(target, prompt, 6)
    first = verifier.prefill("s", prompt, greedy(6))
    assert first.first_token == expected[0] and first.features.start == 0
    full = prompt + expected
    truth = hf_features(target, full)
    torch.testing.assert_close(first.features.rows, truth[: len(prompt)], rtol=1e-7, atol=1e-7)
    # a tree: the true next two tokens behind a decoy sibling
    from specmesh.tree import TokenTree

    tree = TokenTree(np.array([(expected[1] + 1) % 128, expected[1], expected[2]]), np.array([-1, -1, 1]),
                     np.ones(3))
    result = verifier.verify("s", tree)
    assert result.tokens == tuple(expected[1:4])
    assert result.features.start == len(prompt) and len(result.features) == 3  # pending + 2 accepted rows
    torch.testing.assert_close(result.features.rows, truth[len(prompt) : len(prompt) + 3], rtol=1e-7, atol=1e-7)
    assert LocalVerifier(runners[backend]).prefill("t", prompt, greedy(4)).features is None  # off by default


# ------------------------------------------------------------------------------------- exact head state
def _state_tensors(fs: FalconState) -> list[torch.Tensor]:
    n = fs.length
    out, _ = fs.final_block(n - 1)
    h, c = fs.states[n - 1]
    return [fs.outputs.view(n), fs.keys.view(n), fs.values.view(n), out, h, c]


def test_stepwise_lstm_is_the_trained_lstm(runners):
    """Drafting runs the LSTM step by step, training runs nn.LSTM: same outputs and states (float64)."""
    head = random_head(target_tables(runners["fast"]).to(torch.float32), k=2).double()
    gen = torch.Generator().manual_seed(0)
    hidden, layers = head.config.hidden_size, head.config.lstm_layers
    x = torch.randn(3, 5, 2 * hidden, generator=gen, dtype=torch.float64)
    h0, c0 = (torch.randn(layers, 3, hidden, generator=gen, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        want, (h_want, c_want) = head.lstm(x, (h0, c0))
        got, hs, cs = head.lstm_steps(x, h0, c0)
        _, (h_mid, c_mid) = head.lstm(x[:, :3], (h0, c0))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hs[-1], h_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cs[-1], c_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hs[2], h_mid, rtol=1e-10, atol=1e-12)  # the state after every step is kept
    torch.testing.assert_close(cs[2], c_mid, rtol=1e-10, atol=1e-12)


def test_head_state_is_exact_under_rollbacks_and_new_features(target, runners):
    """Random edits (appends, rollbacks of a hypothesis, features arriving late) against a fresh state
    computed once from the same context and features."""
    head = random_head(target_tables(runners["fast"]).to(torch.float32), k=3)
    rng = random.Random(0)
    for trial in range(6):
        seq = PROMPTS[trial % len(PROMPTS)] + naive_greedy(target, PROMPTS[trial % len(PROMPTS)], 30)
        feats = hf_features(target, seq).float()
        fs = FalconState(head)
        committed, context = rng.randint(5, 12), None
        known = 0
        for _ in range(12):
            # the overlapped loop's view: committed tokens + a hypothesis (right or wrong)
            hypo = rng.randint(0, 4)
            context = seq[:committed] + [rng.randrange(128) if rng.random() < 0.3 else t
                                         for t in seq[committed : committed + hypo]]
            fs.truncate_features(len(context))
            if rng.random() < 0.7 and committed - 1 > known:  # features of committed positions arrive
                fs.add_features(known, feats[known : committed - 1])
                known = committed - 1
            fs.sync(context)
            fresh = FalconState(head)
            if known:
                fresh.add_features(0, feats[:known])
            fresh.sync(context)
            for a, b in zip(_state_tensors(fs), _state_tensors(fresh), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            committed = min(len(seq) - 5, committed + rng.randint(1, 4))


def test_features_are_kept_by_the_rows_received(target, runners):
    """A gap before a run of features (rows lost on the way: a prompt cut to its newest rows, a failover) reads as
    zeros and takes no memory: the head state equals one given those zeros explicitly, and one row far past the
    others holds one row, not every position before it."""
    head = random_head(target_tables(runners["fast"]).to(torch.float32), k=2)
    seq = PROMPTS[0] + naive_greedy(target, PROMPTS[0], 20)
    feats = hf_features(target, seq).float()
    gapped, explicit = FalconState(head), FalconState(head)
    assert not gapped.features.dense(-1, 2).any()  # none received: zeros
    gapped.add_features(0, feats[:3])
    gapped.add_features(8, feats[8:12])  # positions 3..7 lost on the way
    explicit.add_features(0, torch.cat([feats[:3], torch.zeros(5, feats.shape[1]), feats[8:12]]))
    assert gapped.known == explicit.known == 12
    assert (gapped.features.num_rows, explicit.features.num_rows) == (7, 12)
    for fs in (gapped, explicit):
        fs.sync(seq[:16])
    for a, b in zip(_state_tensors(gapped), _state_tensors(explicit), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    far = FalconState(head)
    far.add_features(60_000, feats[:1])
    assert far.known == 60_001 and far.features.num_rows == 1
    torch.testing.assert_close(far.features.dense(59_999, 60_001), torch.cat([torch.zeros_like(feats[:1]), feats[:1]]))
    far.truncate_features(50)  # a context of 50 tokens keeps f[0..48]: none here
    assert far.known == 0 and far.features.num_rows == 0


# ------------------------------------------------------------------------------------------ greedy == AR
def _engine(runner, proposer: FalconProposer, budget, overlap: bool, restart_depth=None) -> Engine:
    policy = StaticPolicy(*budget, restart_depth=restart_depth) if overlap else StaticPolicy(*budget)
    return Engine(LocalVerifier(runner, features=True), only(LocalDrafter(proposer), "falcon"), policy,
                  overlap=overlap, strict=True)


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory, target, runners):
    """Heads trained for a second on the tiny target's own greedy text (so that drafts get accepted)."""
    from specmesh_app.train_falcon import FalconTrainConfig, train_falcon

    runner = runners["fast"]
    corpus = tmp_path_factory.mktemp("falcon-corpus")
    ar = Engine(LocalVerifier(runner), (), None)
    for i, prompt in enumerate(make_prompts(24, seed=7)):
        ids = prompt + ar.generate(prompt, greedy(64)).token_ids
        (corpus / f"s{i}.txt").write_text("".join(chr(256 + t) for t in ids))  # _CharTokenizer: ord % 128
    heads = {}
    for k, vocab in ((1, 0), (2, 0), (4, 0), (2, 48)):
        name = k if not vocab else f"{k}-v{vocab}"  # "2-v48": k=2 drafting from 48 of the 128 tokens
        out = tmp_path_factory.mktemp("heads") / f"tiny-falcon-k{name}"
        cfg = FalconTrainConfig(out, out, (corpus,), k=k, seq_len=24, num_seqs=60, heldout_seqs=4, epochs=4,
                                batch_size=4, lr=3e-3, intermediate=64, checkpoint_every=0, draft_vocab=vocab)
        train_falcon(cfg, runner, _CharTokenizer(), progress=False)
        heads[name] = out
    return heads


@pytest.mark.parametrize("overlap,restart_depth", [(False, None), (True, None), (True, 1)],
                         ids=["sequential", "pearl", "pearl-preverify"])
@pytest.mark.parametrize("budget", [(1, 1), (6, 4), (16, 6)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("backend,k", [("fast", 1), ("fast", 2), ("fast", 4), ("hf", 2), ("fast", "2-v48")])
def test_falcon_greedy_equals_ar(target, runners, trained_heads, backend, k, budget, overlap, restart_depth):
    runner = runners[backend]
    proposer = falcon_proposer(target_runner=runner, head=str(trained_heads[k]))
    engine = _engine(runner, proposer, budget, overlap, restart_depth)
    accepted = 0
    for prompt in PROMPTS[:5]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == naive_greedy(target, prompt, MAX_NEW)
        assert res.stats.num_draft_errors == 0
        for s in res.stats.steps:
            assert s.num_proposed <= budget[0] and s.tree_depth <= budget[1]
        accepted += sum(s.num_accepted for s in res.stats.steps)
    assert accepted > 0  # the trees were (partly) accepted: not vacuous


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
def test_fused_with_a_falcon_member_greedy_equals_ar(target, runners, trained_heads, overlap):
    """A trained head as a member of fused (``fused:members=copy+falcon,falcon.head=DIR``): greedy == AR, the
    head's nodes are accepted, and the target's features reach it through the fused proposer."""
    from drafter_service.fusion import fused_proposer

    runner = runners["fast"]
    # copy: one chain, and no node left out by its score (the tiny head's q is low), so the head's nodes are used
    proposer = fused_proposer("copy+falcon", min_score=0.0, target_runner=runner,
                              **{"falcon.head": str(trained_heads[1]), "copy.max_matches": 1})
    falcon = proposer.members[1]
    assert isinstance(falcon, FalconProposer) and falcon.head.config.k == 1 and proposer.feedback_features
    received, observe = [], falcon.observe

    def spy(state, feedback):
        received.append(sum(f.rows.shape[0] for f in feedback.features))
        observe(state, feedback)

    falcon.observe = spy
    engine = _engine(runner, proposer, (16, 6), overlap)
    accepted = Counter()
    for prompt in PROMPTS[:4]:
        res = engine.generate(prompt, greedy(MAX_NEW))
        assert res.token_ids == naive_greedy(target, prompt, MAX_NEW)
        assert res.stats.num_draft_errors == 0
        for s in res.stats.steps:
            accepted.update(s.accepted_sources)
    assert accepted["falcon"] > 0 and sum(received) >= 4 * MAX_NEW // 2


def test_trees_honour_budgets_and_stop_rule(runners):
    proposer = falcon_proposer(target_runner=runners["fast"], k=2)
    drafter = LocalDrafter(proposer)
    for sp in (greedy(8), SamplingParams(temperature=0.9, max_new_tokens=8, seed=3)):
        drafter.open("s", PROMPTS[2], sp)
        for nodes, depth in [(1, 1), (3, 5), (9, 3), (30, 7)]:
            tree = drafter.propose("s", [], Budget(nodes, depth)).validate(128, nodes, depth)
            assert tree.num_nodes >= 1
            assert (tree.q_cu is None) == sp.greedy
        tight = drafter.propose("s", [], Budget(30, 7, min_path_prob=0.5))
        assert tight.num_nodes <= 30
        drafter.close("s")


def test_static_tree_has_its_shape_and_dynamic_follows_confidence(runners):
    """A static tree is the same shape for every context (until the budget cuts it); a dynamic one gives a
    token node only the children needed to cover ``cover`` of q (a tiny cover: one child each, a chain)."""
    runner = runners["fast"]
    static = LocalDrafter(falcon_proposer(target_runner=runner, k=2, tree="static", shape="1x3/2x2"))
    for prompt in PROMPTS[:3]:
        static.open("s", prompt, greedy(8))
        tree = static.propose("s", [], Budget(64, 8)).validate(128, 64, 8)
        # root block: 3 + 3*3; then 2 block ends, each 2 + 2*2
        assert tree.num_nodes == 12 + 2 * 6
        assert np.bincount(tree.depth).tolist() == [3, 9, 4, 8]
        assert static.propose("s", [], Budget(10, 8)).num_nodes == 10  # the budget still holds
        static.close("s")
    chain = LocalDrafter(falcon_proposer(target_runner=runner, k=2, tree="dynamic", cover=1e-9))
    chain.open("c", PROMPTS[0], greedy(8))
    tree = chain.propose("c", [], Budget(64, 6))
    assert tree.num_nodes == 6 and tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    chain.close("c")
    with pytest.raises(ValueError, match="shape"):
        falcon_proposer(target_runner=runner, k=2, tree="static", shape="4x2")
    with pytest.raises(ValueError, match="NxM"):
        falcon_proposer(target_runner=runner, k=2, tree="static", shape="1x2/two")
    with pytest.raises(ValueError, match="tree must be"):
        falcon_proposer(target_runner=runner, k=2, tree="bushy")


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("tree,shape", [("static", "1x4/4x2/2x2"), ("static", "1x1/1x1/1x1"), ("dynamic", None)])
def test_falcon_tree_modes_greedy_equal_ar(target, runners, trained_heads, tree, shape, overlap):
    runner = runners["fast"]
    options = {"tree": tree} | ({"shape": shape} if shape else {"cover": 0.5})
    proposer = falcon_proposer(target_runner=runner, head=str(trained_heads[2]), **options)
    engine = _engine(runner, proposer, (16, 6), overlap)
    for prompt in PROMPTS[:4]:
        assert engine.generate(prompt, greedy(MAX_NEW)).token_ids == naive_greedy(target, prompt, MAX_NEW)


def test_head_stores_its_measured_tree(tmp_path, runners, trained_heads):
    """``config.json`` ``tree`` (written by measuring) is the proposer's default; options override it."""
    import json
    import shutil

    head = tmp_path / "tiny-falcon"
    shutil.copytree(trained_heads[2], head)
    meta = json.loads((head / "config.json").read_text())
    meta["tree"] = {"tree": "static", "shape": "1x2/2x2"}
    (head / "config.json").write_text(json.dumps(meta))
    proposer = falcon_proposer(target_runner=runners["fast"], head=str(head))
    assert proposer.tree == "static" and proposer.shape == ((1, 2), (2, 2))
    assert falcon_proposer(target_runner=runners["fast"], head=str(head), tree="dynamic").tree == "dynamic"


# ------------------------------------------------------------------------------- lossless sampling
@pytest.fixture(scope="module")
def e2e():
    target = tiny_llama(seed=5, vocab=8, hidden=32, heads=2, kv_heads=1, intermediate=64)
    return target, make_runner(target, "fast")


def falcon_pairs(runner, proposer: FalconProposer, warp: str, overlap: bool) -> tuple[Counter, int]:
    """(counts of the 2nd and 3rd generated tokens of E2E_SAMPLES seeded samples, draft tokens accepted) on the
    engine core: ``CORE_IN_FLIGHT`` requests in flight, one head drafting for all, as `serve` runs it."""
    from spec_helpers import results_on_core

    from orchestrator.requests import Method

    temperature, top_k, top_p = WARPS[warp]
    jobs = [(E2E_PROMPT, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i, max_new_tokens=4,
                                        ignore_eos=True)) for i in range(E2E_SAMPLES)]
    policy = StaticPolicy(6, 4, restart_depth=0) if overlap else StaticPolicy(6, 4)
    method = Method(only(LocalDrafter(proposer), "falcon"), policy, features=True, strict=True, overlap=overlap)
    results = results_on_core(LocalVerifier(runner, features=True), method, jobs)
    counts = Counter(tuple(res.token_ids[1:3]) for res in results)
    return counts, sum(s.num_accepted for res in results for s in res.stats.steps)


@pytest.mark.parametrize("overlap,warp", [(False, "plain"), (True, "plain"), (False, "topk_topp"), (True, "topk_topp")],
                         ids=["core-sequential-plain", "core-pearl-plain", "core-sequential-topk_topp",
                              "core-pearl-topk_topp"])
@pytest.mark.slow
def test_falcon_sampling_matches_target_distribution(e2e, overlap, warp):
    model, runner = e2e
    proposer = FalconProposer(random_head(target_tables(runner).to(torch.float32), k=2, seed=1), samples=2)
    counts, accepted = falcon_pairs(runner, proposer, warp, overlap)
    assert chisquare_p(counts, exact_pair_law(model, E2E_PROMPT, WARPS[warp])) > P_PASS
    # the tree's sampled nodes were accepted, not all rejected (PEARL with restart depth 0: only trees drafted
    # ahead are verified, used when the sampled bonus token was guessed)
    assert accepted > (0.005 if overlap else 0.05) * E2E_SAMPLES


def test_reduced_vocabulary_falcon_sampling_matches_target_distribution(e2e):
    """Drafting from 5 of the 8 tokens: three tokens always have q = 0, and the output law is still the target's."""
    model, runner = e2e
    head = random_head(target_tables(runner).to(torch.float32), k=2, seed=1, draft_vocab=5)
    counts, accepted = falcon_pairs(runner, FalconProposer(head, samples=2), "plain", False)
    assert chisquare_p(counts, exact_pair_law(model, E2E_PROMPT, WARPS["plain"])) > P_PASS
    assert accepted > 0.05 * E2E_SAMPLES
    outside = set(range(8)) - set(head.vocab_ids.tolist())
    assert any(t in outside for key in counts for t in key)  # tokens the head cannot draft still come out


# ---------------------------------------------------------------------------------------------- training
class _CharTokenizer:
    """Text -> ids mod the tiny vocabulary (the trainer only needs ``tokenizer(text)["input_ids"]``)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(ch) % 128 for ch in text]}


def test_train_falcon_tiny_head_loss_falls_and_loads(tmp_path, target, runners):
    from specmesh_app.train_falcon import FalconTrainConfig, train_falcon

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print", "(", ")", ":"]
    for i in range(8):
        (corpus / f"f{i}.py").write_text(" ".join(rng.choice(words) for _ in range(400)))
    runner = runners["fast"]
    for glancing, k in [(True, 2), (False, 2), (True, 1)]:
        out = tmp_path / f"head-falcon-{k}-{glancing}"
        cfg = FalconTrainConfig(tmp_path / "target", out, (corpus,), k=k, glancing=glancing, seq_len=32,
                                num_seqs=24, heldout_seqs=4, epochs=3, batch_size=4, lr=3e-3, intermediate=64,
                                checkpoint_every=5)
        report = train_falcon(cfg, runner, _CharTokenizer(), progress=False)
        assert report["after"]["heldout_loss"] < report["before"]["heldout_loss"], report
        head = load_head(out, target_tables(runner).to(torch.float32))
        # glancing has nothing to replace inside a one-token block: a k=1 head is recorded as plain
        assert head.config.k == k and head.config.glancing == (glancing and k > 1)
        proposer = falcon_proposer(target_runner=runner, head=str(out))
        engine = _engine(runner, proposer, (8, 4), overlap=False)
        assert engine.generate(PROMPTS[0], greedy(10)).token_ids == naive_greedy(target, PROMPTS[0], 10)
    # a rerun resumes from the finished checkpoint: no more steps
    again = train_falcon(cfg, runner, _CharTokenizer(), progress=False)
    assert again["steps"] == report["steps"]
    # a reduced draft vocabulary: the corpus's most frequent tokens, agreement still with the target's argmax
    out = tmp_path / "head-falcon-v16"
    cfg = FalconTrainConfig(tmp_path / "target", out, (corpus,), k=2, seq_len=32, num_seqs=24, heldout_seqs=4,
                            epochs=3, batch_size=4, lr=3e-3, intermediate=64, checkpoint_every=0, draft_vocab=16)
    report = train_falcon(cfg, runner, _CharTokenizer(), progress=False)
    after = report["after"]
    assert report["draft_vocab"] == 16 and after["heldout_loss"] < report["before"]["heldout_loss"], report
    assert 0 < after["vocab_coverage"] <= 1 and max(after["agree_per_slot"]) <= after["vocab_coverage"] + 1e-9
    head = load_head(out, target_tables(runner).to(torch.float32))
    text = "".join((corpus / f"f{i}.py").read_text() for i in range(8))
    common = Counter(ord(ch) % 128 for ch in text).most_common(4)
    assert {t for t, _ in common} <= set(head.vocab_ids.tolist())


def test_glancing_schedule_and_rows():
    from specmesh_app.train_falcon import glance_lambda, glanced_rows

    assert glance_lambda(0, 4) == pytest.approx(0.4) and glance_lambda(3, 4) == pytest.approx(0.1)
    assert glance_lambda(0.5, 1) == pytest.approx(0.2) and glance_lambda(1, 1) == 0.0  # falls within an epoch
    rows = glanced_rows([10, 0, 3], 20, 2, 0.4, random.Random(0))
    assert [len(r) for r in rows] == [4, 0, 1]
    assert all(r % 2 == 0 for r in rows[0])  # k=2: one row from each chosen block's start
    rows = glanced_rows([12], 24, 4, 0.4, random.Random(1))[0]
    assert len(rows) == 5 and all(r % 4 < 3 for r in rows)  # never a whole block
    assert glanced_rows([50], 20, 1, 0.4, random.Random(0)) == [[]]  # k=1: nothing to glance


def test_drafter_server_refuses_falcon_without_its_target():
    """Over gRPC (tests/test_falcon_grpc.py) the drafter shares a --target's tables; without one it refuses."""
    import argparse

    from drafter_service import server

    args = argparse.Namespace(proposers=["falcon"], draft="none", target=None, falcon=None, command="drafter")
    with pytest.raises(SystemExit, match="--target DIR"):
        server.build_servicer(args)


def test_drafter_server_needs_the_target_for_a_falcon_member_too():
    import argparse

    from drafter_service import server

    args = argparse.Namespace(proposers=["fused"], members="copy+falcon", draft="none", target=None, falcon=None,
                              command="drafter")
    with pytest.raises(SystemExit, match="falcon needs the target model"):
        server.build_servicer(args)
    args = argparse.Namespace(proposers=["fused"], members="copy+recycling", draft="none", target=None, falcon="/h",
                              command="drafter")
    with pytest.raises(SystemExit, match="--falcon is for the falcon proposer"):
        server.build_servicer(args)
