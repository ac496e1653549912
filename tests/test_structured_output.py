"""Structured output (``SamplingParams.grammar``: JSON Schema, JSON object, regex, Lark) under speculation.

The verifier masks the target's distribution with the grammar at every verified row and prunes drafted nodes the
grammar rules out where that is exact; the grammar also drafts (the ``grammar`` proposer, jump-forward). Checked:
the tree walk against consuming each path on its own, greedy output equal to a naive constrained decoding for every
proposer, every output valid, and sampling under a grammar against the exact constrained law (chi-square).
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import numpy as np
import pytest
import torch
from service_helpers import TARGET
from spec_helpers import make_runner, tiny_llama
from test_sampling_distribution import P_PASS, chisquare_p

from drafter_service.grammar_proposer import graft
from drafter_service.proposer import proposer_names
from specmesh.grammar import GrammarError, GrammarTokenizer, prunable, tree_masks
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
GRAMMARS = {
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
    "json_object": ("json_object", ""),
    "regex": ("regex", r"(def|class) [a-z_]{1,12}\((self)?\):"),
    "lark": ("lark", 'start: "x = " NUMBER ("," " " NUMBER)*\nNUMBER: /[0-9]{1,3}/'),
}
PROMPTS = ["def make_record():\n    return ", "import json\n\nconfig = ", "# a point\n"]


@pytest.fixture(scope="module")
def hf_target():
    """The demo target as transformers runs it (float64, as the demo stack): the naive references' model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def grammar_tokenizer(demo_stack):
    info = demo_stack.target_runner.info
    return GrammarTokenizer.for_model(TARGET, info.vocab_size, info.eos_token_ids)


@torch.no_grad()
def naive_constrained_greedy(model, tokenizer: GrammarTokenizer, grammar, prompt, max_new: int, eos) -> list[int]:
    """Plain greedy decoding under the grammar: the whole sequence recomputed, the grammar's mask applied to the
    last row, one token at a time (no tree, no pruning)."""
    state = tokenizer.state(*grammar)
    ids, out = list(prompt), []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        allowed = state.allowed()
        if not allowed.any():
            allowed[list(eos)] = True
        tok = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(tok)
        if tok in eos:
            break
        assert state.consume([tok])
        ids.append(tok)
    return out


def check_valid(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------- the pure parts
def test_tree_masks_equal_consuming_each_path_alone(grammar_tokenizer):
    rng = np.random.default_rng(0)
    state = grammar_tokenizer.state(*GRAMMARS["json_schema"])
    tok = grammar_tokenizer.tokenizer
    assert state.consume(tok.tokenize_str('{"name": "a'))
    before = state.allowed()
    allowed_ids = before.nonzero()[:, 0].numpy()
    for _ in range(20):  # random trees mixing allowed and arbitrary tokens
        n = int(rng.integers(1, 12))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)])
        tokens = np.where(rng.random(n) < 0.7, rng.choice(allowed_ids, n), rng.integers(0, 4096, n))
        tree = TokenTree(tokens, parents, np.ones(n))
        valid, masks = tree_masks(state, tree)
        assert torch.equal(masks[0], before) and torch.equal(state.allowed(), before)  # back where it started
        for i in range(n):
            alone = grammar_tokenizer.state(*GRAMMARS["json_schema"])
            alone.consume(tok.tokenize_str('{"name": "a'))
            path = tree.tokens[tree.path_to(i)].tolist()
            ok = all(bool(alone.allowed()[t]) and alone.consume([t]) for t in path)
            assert valid[i] == ok
            if ok:
                assert torch.equal(masks[1 + i], alone.allowed())


def test_select_graft_and_prunable():
    tree = TokenTree(np.array([5, 6, 7, 8]), np.array([-1, 0, -1, 2]), np.array([0.5, 0.4, 0.3, 0.2]), ("a",) * 4,
                     q_cu=np.array([0, 2, 3, 4, 5]), q_ids=np.array([5, 9, 6, 7, 8]),
                     q_probs=np.array([0.5, 0.5, 1.0, 1.0, 1.0]))
    kept = tree.select(np.array([True, False, True, True]))
    assert kept.tokens.tolist() == [5, 7, 8] and kept.parents.tolist() == [-1, -1, 1]
    assert kept.draft_dist(0)[0].tolist() == [5, 9] and kept.draft_dist(2)[0].tolist() == [8]
    with pytest.raises(ValueError):
        tree.select(np.array([False, True, True, True]))
    grafted = graft(TokenTree.chain([1, 2], source="grammar"), tree)
    assert grafted.tokens.tolist() == [1, 2, 5, 6, 7, 8] and grafted.parents.tolist() == [-1, 0, 1, 2, 1, 4]
    assert grafted.draft_dist(0)[0].tolist() == [1] and grafted.draft_dist(2)[0].tolist() == [5, 9]
    assert prunable(tree, greedy=True) and not prunable(tree, greedy=False)
    assert prunable(TokenTree.chain([1, 2]), greedy=False)  # point masses


def test_bad_grammars_and_no_tokenizer_are_refused(grammar_tokenizer):
    for grammar in [("json_schema", "{not json"), ("regex", "(unclosed"), ("lark", "start: nothing_defined")]:
        with pytest.raises(GrammarError):
            grammar_tokenizer.check(*grammar)
    with pytest.raises(ValueError):
        SamplingParams(grammar=("yaml", "x"))
    with pytest.raises(ValueError):
        SamplingParams(grammar=("regex", ""))
    runner = make_runner(tiny_llama(seed=1, vocab=64), "fast")
    with pytest.raises(ValueError, match="tokenizer"):
        LocalVerifier(runner).admit("s", [1, 2], SamplingParams(grammar=GRAMMARS["json_object"]))

def test_a_server_without_structured_requests_never_loads_the_grammar_library(demo_stack, monkeypatch):
    """Building the tokenizer is deferred to the first grammar: a verifier starts (and serves plain requests) where
    llguidance cannot be imported, and the first structured request says what is missing."""
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # `import llguidance` raises ImportError
    info = demo_stack.target_runner.info
    tokenizer = GrammarTokenizer.for_model(TARGET, info.vocab_size, info.eos_token_ids)
    verifier = LocalVerifier(demo_stack.target_runner, grammar_tokenizer=tokenizer)
    verifier.admit("plain", [1, 2, 3], SamplingParams())
    with pytest.raises(ImportError, match="llguidance"):
        verifier.admit("structured", [1, 2, 3], SamplingParams(grammar=GRAMMARS["regex"]))
    verifier.release("plain")


# ---------------------------------------------------------------- greedy: every proposer
@pytest.fixture(scope="module")
def references(demo_stack, grammar_tokenizer, hf_target):
    memo = {}

    def get(kind: str, prompt: str, max_new: int) -> list[int]:
        if (kind, prompt) not in memo:
            model = hf_target
            ids = demo_stack.tokenizer.encode(prompt)
            memo[kind, prompt] = naive_constrained_greedy(model, grammar_tokenizer, GRAMMARS[kind], ids, max_new,
                                                          set(demo_stack.target_runner.info.eos_token_ids))
        return memo[kind, prompt]

    return get


def test_plain_constrained_decoding_matches_the_naive_reference(demo_stack, references):
    for kind in GRAMMARS:
        for prompt in PROMPTS:
            sp = SamplingParams(max_new_tokens=48, grammar=GRAMMARS[kind])
            res = demo_stack.engine(None).generate(demo_stack.tokenizer.encode(prompt), sp)
            assert res.token_ids == references(kind, prompt, 48), (kind, prompt)
            if res.finish_reason == "stop":
                check_valid(kind, demo_stack.decode(res.token_ids))
    assert demo_stack.decode(references("json_schema", PROMPTS[0], 48)).startswith('{"name": "')


@pytest.mark.parametrize("proposer", [*(p for p in proposer_names() if p not in ("falcon", "mjsd")),
                                      "grammar:then=draft_model", "grammar:then=copy"])
def test_speculative_constrained_greedy_equals_plain(demo_stack, references, proposer):
    name, _, options = proposer.partition(":")
    opts = dict(kv.split("=") for kv in options.split(",")) if options else {}
    engine = demo_stack.engine(name, overlap=False, **opts)
    accepted = 0
    for kind in GRAMMARS:
        for prompt in PROMPTS:
            sp = SamplingParams(max_new_tokens=48, grammar=GRAMMARS[kind])
            res = engine.generate(demo_stack.tokenizer.encode(prompt), sp)
            assert res.token_ids == references(kind, prompt, 48), (kind, prompt)
            assert res.stats.num_draft_errors == 0
            accepted += sum(s.num_accepted for s in res.stats.steps)
    if name in ("grammar", "copy", "fused", "draft_model", "draft_model_tree"):
        assert accepted > 0


def test_the_grammar_drafts_what_it_forces(demo_stack):
    """JSON keys and their separators are forced: the grammar proposer's drafts are accepted whole."""
    engine = demo_stack.engine("grammar", overlap=False, then="none")
    res = engine.generate(demo_stack.tokenizer.encode(PROMPTS[0]),
                          SamplingParams(max_new_tokens=48, grammar=GRAMMARS["json_schema"]))
    drafted = [s for s in res.stats.steps if s.num_proposed]
    assert drafted and all(s.num_accepted == s.num_proposed for s in drafted)
    assert res.stats.tau > 1.1


# ---------------------------------------------------------------- sampling: the constrained law
CHOICE = ("regex", "(yes|no|maybe)-(yes|no|maybe)\n")


def constrained_law(model, tokenizer: GrammarTokenizer, prompt, steps: int) -> dict[tuple, float]:
    """P(first ``steps`` generated tokens) under sampling (temperature 1) with the grammar's mask: the exact law,
    enumerated over the few sequences the grammar allows."""
    law = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, pr in law.items():
            state = tokenizer.state(*CHOICE)
            assert state.consume(list(seq))
            allowed = state.allowed()
            with torch.no_grad():
                logits = model(torch.tensor([list(prompt) + list(seq)])).logits[0, -1].double()
            p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
            for t in allowed.nonzero()[:, 0].tolist():
                nxt[seq + (t,)] = pr * float(p[t])
        law = nxt
    return law


@pytest.mark.parametrize("proposer", ["draft_model_tree", "prompt_lookup_tree", "grammar:then=draft_model"],
                         ids=["core-draft_model_tree", "core-prompt_lookup_tree", "core-grammar"])
@pytest.mark.slow
def test_speculative_sampling_under_a_grammar_has_the_constrained_law(demo_stack, grammar_tokenizer, hf_target,
                                                                     proposer):
    """On the stack's engine core: 16 requests in flight, each with its own grammar state in the batch, as `serve`
    runs them."""
    from concurrent.futures import ThreadPoolExecutor

    name, _, options = proposer.partition(":")
    opts = dict(kv.split("=") for kv in options.split(",")) if options else {}
    # prompt lookup finds continuations here (point masses: the ones the grammar rules out are pruned)
    prompt = demo_stack.tokenizer.encode("yes-no\nno-maybe\nmaybe-yes\nyes-")
    law = constrained_law(hf_target, grammar_tokenizer, prompt, 3)
    engine = demo_stack.engine(name, 6, 3, overlap=False, policy="static", fresh=True, **opts)

    def sample(seed: int):
        return engine.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=3, ignore_eos=True,
                                                      grammar=CHOICE))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(sample, range(1200)))
    counts = Counter(tuple(res.token_ids[:3]) for res in results)
    assert sum(s.num_accepted for res in results for s in res.stats.steps) > 0
    assert chisquare_p(counts, law) > P_PASS
