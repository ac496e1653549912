"""`specmesh bench` end to end on a tiny random Llama pair saved to disk, plus its pure helpers.

The invariants: every lossless specmesh method reproduces AR greedy output token for
token, τ >= 1, every method has one record per prompt, and τ / forward counts are
consistent for HF peers too (counted with hooks on the same models).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specmesh_app import cli
from specmesh_app.bench import is_loop, method_names, parse_method, spread

EOS_TOKEN = "<|endoftext|>"
TEXT = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20
PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):", "max_new_tokens": 12},
    {"id": "p1", "prompt": "class Point:\n    def __init__(self, x, y):\n        self.x = x", "max_new_tokens": 12},
    {"id": "p2", "prompt": "for i in range(10):\n    print(i)", "max_new_tokens": 12},
]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def _save_model(path: Path, tokenizer, hidden: int, layers: int, seed: int) -> None:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,  # a large init keeps greedy output from collapsing onto one token
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench_pair")
    tokenizer = _tokenizer()
    _save_model(root / "target", tokenizer, hidden=32, layers=2, seed=0)
    _save_model(root / "draft", tokenizer, hidden=16, layers=1, seed=1)
    _save_model(root / "same", tokenizer, hidden=32, layers=2, seed=0)  # the target's own weights
    with (root / "prompts.jsonl").open("w") as f:
        for row in PROMPTS:
            f.write(json.dumps(row) + "\n")
    return root


def _bench(pair: Path, out: Path, *extra: str, draft: str | None = "draft") -> dict:
    args = cli.build_parser().parse_args([
        "bench", "--prompts", str(pair / "prompts.jsonl"), "--target", str(pair / "target"),
        *(["--draft", str(pair / draft)] if draft else []),
        # float64: a tree forward and a sequential forward can never disagree on an argmax
        "--dtype", "float64", "--draft-dtype", "float64",
        "--threads", "1", "--json", str(out), *extra,
    ])  # fmt: skip
    assert args.func(args) == 0
    return json.loads(out.read_text())


def test_bench_greedy_report(pair, tmp_path, capsys):
    # draft_model sequential: with overlap (the default) whether a drafted-ahead tree reaches the verifier
    # depends on timing, and on a loaded machine none may in 2 short prompts (no acceptance to check)
    methods = ["ar", "draft_model:overlap=0", "prompt_lookup", "hf_ar", "hf_assisted", "hf_prompt_lookup"]
    report = _bench(pair, tmp_path / "out.json", "--methods", *methods, "--limit", "2")
    assert list(report["methods"]) == methods
    assert report["config"]["num_prompts"] == 2
    assert report["environment"]["torch"] == torch.__version__
    assert report["config"]["dtype"] == report["config"]["draft_dtype"] == "torch.float64"

    for method in methods:
        records = [r for r in report["records"] if r["method"] == method]
        assert sorted(r["prompt_id"] for r in records) == ["p0", "p1"]
        for r in records:
            assert 1 <= r["num_generated"] <= 12
            assert r["target_forwards"] >= 1
        agg = report["methods"][method]
        assert agg["tau"] >= 1.0
        assert agg["speedup_vs_ar"]["median"] > 0
        # every generated token after the first costs at most one target forward
        assert agg["target_forwards_per_token"] <= 1.0 + 1e-9

    for method in ("ar", "draft_model:overlap=0", "prompt_lookup"):  # lossless: exactly AR greedy
        assert report["methods"][method]["greedy_match_ar"] == 1.0
    ar = report["methods"]["ar"]
    assert ar["tau"] == 1.0 and ar["target_forwards_per_token"] == 1.0
    assert report["methods"]["hf_ar"]["tau"] == 1.0
    for method in ("hf_assisted", "hf_prompt_lookup"):
        assert report["methods"][method]["speedup_vs_hf_ar"] is not None

    # specmesh τ agrees with the hook-counted forwards: one prefill + one forward per step
    for r in report["records"]:
        if r["kind"] == "specmesh":
            assert r["target_forwards"] == 1 + r["steps"]
            assert r["committed"] >= r["num_generated"] - 1
    dm = report["methods"]["draft_model:overlap=0"]
    assert dm["acceptance_per_position"] and all(0.0 <= a <= 1.0 for a in dm["acceptance_per_position"] if a is not None)
    assert dm["draft_forwards_per_token"] > 0 and set(dm["per_source"]) == {"draft_model"}

    table = capsys.readouterr().out
    assert "| method | τ |" in table and all(f"| {m} |" in table for m in methods)


def test_bench_always_accept_drafter(pair, tmp_path):
    """Draft = target: every drafted token is accepted, so τ is the budget-limited maximum.

    Confidence cut-offs are off on both sides: a random model is rarely confident. Sequential
    loop (overlap=0): with overlap, how much is drafted ahead depends on timing.
    """
    chain = "draft_model:max_nodes=4,max_depth=4,min_confidence=0,overlap=0"
    report = _bench(
        pair, tmp_path / "out.json", "--methods", chain,
        "hf_assisted:assistant_confidence_threshold=0", "--limit", "1", draft="same",
    )  # fmt: skip
    dm = report["methods"][chain]
    # 12 tokens: prefill 1, then 1 + 4, 1 + 4, and a last plain step (no room left to draft)
    assert dm["tau"] == pytest.approx(11 / 3)
    assert dm["acceptance_per_position"] == [1.0, 1.0, 1.0, 1.0]
    assert dm["greedy_match_ar"] == 1.0
    hf = report["methods"]["hf_assisted:assistant_confidence_threshold=0"]
    assert hf["tau"] > 3.0 and hf["greedy_match_ar"] == 1.0


def test_bench_sampling_has_no_greedy_match(pair, tmp_path):
    report = _bench(
        pair, tmp_path / "results" / "out.json", "--methods", "prompt_lookup:max_nodes=4,max_depth=4",
        "--limit", "1", "--temperature", "0.7", "--top-p", "0.95", "--max-new-tokens", "6",
    )  # fmt: skip
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["out.json"]  # directory made, no temporary left
    assert list(report["methods"]) == ["ar", "prompt_lookup:max_nodes=4,max_depth=4"]  # ar is always added
    assert report["config"]["methods"][1]["options"] == {"max_nodes": 4, "max_depth": 4}
    for agg in report["methods"].values():
        assert agg["greedy_match_ar"] is None
        assert agg["generated_tokens"] <= 6


def test_bench_mjsd_is_labelled_lossy_and_scored_by_perplexity(pair, tmp_path, capsys):
    """The lossy method: its rows say so (table and JSON), a mismatch with ar is reported, not failed, and the
    target's perplexity of its outputs and of ar's is measured; a threshold nothing reaches gives ar's output."""
    methods = ["ar", "prompt_lookup", "mjsd:threshold=0.05,beam_width=4", "mjsd:threshold=1e300"]
    report = _bench(pair, tmp_path / "out.json", "--methods", *methods, "--limit", "2")
    agg = report["methods"]
    lossy, never = agg["mjsd:threshold=0.05,beam_width=4"], agg["mjsd:threshold=1e300"]
    assert lossy["lossy"] and lossy["acceptance"] == "mjsd" and never["lossy"]
    assert not agg["ar"]["lossy"] and agg["ar"]["acceptance"] == "exact"
    assert never["greedy_match_ar"] == 1.0 and never["tau"] == 1.0  # nothing accepted: the target's own tokens
    for label in ("ar", "mjsd:threshold=0.05,beam_width=4", "mjsd:threshold=1e300"):
        assert agg[label]["perplexity"] >= 1.0
    assert never["perplexity"] == pytest.approx(agg["ar"]["perplexity"], rel=1e-9)
    assert agg["prompt_lookup"]["perplexity"] is None  # lossless methods only with --perplexity
    records = [r for r in report["records"] if r["method"] == "ar"]
    assert all(r["target_nll"] >= 0 and r["acceptance"] == "exact" for r in records)
    table = capsys.readouterr().out
    assert "| mjsd:threshold=1e300 (LOSSY) |" in table and "| ar |" in table and "LOSSY (output differs" in table
    scored = _bench(pair, tmp_path / "all.json", "--methods", "ar", "prompt_lookup", "--limit", "1", "--perplexity")
    assert all(m["perplexity"] >= 1.0 for m in scored["methods"].values())


@pytest.mark.parametrize(("methods", "extra", "message"), [
    (["mjsd"], ["--temperature", "0.7"], "greedy only"),
    (["draft_model:threshold=0.3"], [], "mjsd proposer only"),
])
def test_bench_refuses_lossy_misuse(pair, tmp_path, methods, extra, message):
    with pytest.raises(SystemExit, match=f"specmesh bench: .*{message}"):
        _bench(pair, tmp_path / "out.json", "--methods", *methods, *extra)


def test_bench_chat_wraps_prompts_in_the_targets_template(pair, tmp_path):
    """--chat: each prompt is the user message of the target's chat template (assistant turn opened), encoded
    without adding special tokens again; a target without a template is a one-line error."""
    import shutil

    from transformers import AutoTokenizer

    chat = tmp_path / "chat-target"
    shutil.copytree(pair / "target", chat)
    (chat / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ bos_token }}user: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    args = ["--methods", "prompt_lookup_tree", "--limit", "2", "--max-new-tokens", "6", "--target", str(chat)]
    report = _bench(pair, tmp_path / "chat.json", *args, "--chat", draft=None)
    assert report["config"]["chat"] is True
    tokenizer = AutoTokenizer.from_pretrained(chat)
    for row, rec in zip(PROMPTS, [r for r in report["records"] if r["method"] == "ar"], strict=False):
        text = f"{EOS_TOKEN}user: {row['prompt']}\nassistant:"
        assert rec["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert report["methods"]["prompt_lookup_tree"]["greedy_match_ar"] == 1.0
    raw = _bench(pair, tmp_path / "raw.json", *args, draft=None)
    assert raw["config"]["chat"] is False
    assert [r["prompt_tokens"] for r in raw["records"]] != [r["prompt_tokens"] for r in report["records"]]
    with pytest.raises(SystemExit, match="has no chat template"):
        _bench(pair, tmp_path / "none.json", "--methods", "prompt_lookup", "--limit", "1", "--chat", draft=None)


def test_bench_default_methods_without_draft(pair, tmp_path):
    report = _bench(pair, tmp_path / "out.json", "--limit", "1", "--max-new-tokens", "4", draft=None)
    methods = list(report["methods"])
    assert {"ar", "prompt_lookup", "prompt_lookup_tree", "hf_ar", "hf_prompt_lookup"} <= set(methods)
    assert not {"draft_model", "draft_model_tree", "hf_assisted"} & set(methods)  # no draft model given
    assert "falcon" not in methods  # a feature head only when named with its head (falcon:head=DIR)
    assert all(m["greedy_match_ar"] == 1.0 for label, m in report["methods"].items() if not label.startswith("hf_"))


@pytest.mark.parametrize(
    ("methods", "draft", "message"),
    [
        (["nope"], "draft", "unknown method"),
        (["draft_model:max_nodes"], "draft", "not KEY=VALUE"),
        (["ar:max_nodes=3"], "draft", "takes no options"),
        (["ar", "ar"], "draft", "duplicate"),
        (["hf_assisted"], None, "need a draft model"),
    ],
)
def test_bench_usage_errors_exit_cleanly(pair, tmp_path, methods, draft, message):
    with pytest.raises(SystemExit, match=f"specmesh bench: .*{message}"):
        _bench(pair, tmp_path / "out.json", "--methods", *methods, draft=draft)


@pytest.mark.parametrize("where", ["a_file/out.json", "a_dir", "read_only/out.json"])
def test_bench_refuses_an_unwritable_json_before_the_first_prompt(pair, tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("x")  # a file where a directory should be: unwritable for root too
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "read_only").mkdir(mode=0o500)
    if where.startswith("read_only") and os.access(tmp_path / "read_only", os.W_OK):
        pytest.skip("running as root: a read-only directory is writable")
    out = tmp_path / where
    with pytest.raises(SystemExit, match=f"^specmesh bench: --json {out}: [^\\n]+$"):
        _bench(pair, out, "--methods", "ar", "prompt_lookup", "--limit", "1")
    captured = capsys.readouterr()
    assert "warm-up" not in captured.err and "prompt" not in captured.err and not captured.out  # nothing ran
    assert not any((tmp_path / "a_dir").iterdir()) and not any((tmp_path / "read_only").iterdir())


def test_parse_method():
    known = method_names()
    spec = parse_method("draft_model_tree:max_nodes=8,branching=2", known)
    assert spec.name == "draft_model_tree"
    assert dict(spec.options)["max_nodes"] == 8 and dict(spec.options)["branching"] == 2
    assert "max_depth" in dict(spec.options)  # unset budget keys take the proposer's default
    assert dict(parse_method("hf_prompt_lookup", known).options) == {"prompt_lookup_num_tokens": 10}
    assert dict(parse_method("hf_assisted:assistant_confidence_threshold=0.2", known).options) == {
        "assistant_confidence_threshold": 0.2
    }
    for bad in ("nope", "draft_model:max_nodes", "ar:max_nodes=3"):
        with pytest.raises(ValueError):
            parse_method(bad, known)


def test_is_loop():
    assert is_loop([5, 6, 7] * 30)  # period 3
    assert is_loop(list(range(100)) + [1, 2, 3, 4, 5, 6] * 11)  # periodic tail after a non-periodic start
    counter = [t for i in range(8) for t in (10, 11, 12, 13, 14, 100 + i)]  # a loop whose counter changes
    assert is_loop(list(range(50, 80)) + counter)
    assert not is_loop(list(range(200)))
    assert not is_loop([5, 6, 7] * 10)  # too short to judge (< 64 tokens)


def test_spread():
    s = spread([1.0, 2.0, 3.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and math.isclose(s["p10"], 1.3)
    assert spread([]) is None


def test_parse_grpc_methods():
    known = method_names()
    spec = parse_method("grpc:draft_model_tree:max_nodes=6", known)
    assert spec.is_grpc and spec.base_name == "draft_model_tree"
    assert dict(spec.options) == {"max_nodes": 6, "max_depth": 4}  # unset depth: the proposer's default
    assert parse_method("grpc:ar", known).options == ()
    with pytest.raises(ValueError):
        parse_method("grpc:ar:max_nodes=2", known)


def test_bench_through_a_spawned_mesh(pair, tmp_path):
    """grpc: methods through verifier/drafter/serve processes: same tokens as in process, and the
    per-step overhead is reported against the in-process twin."""
    report = _bench(pair, tmp_path / "out.json", "--spawn-mesh", "--methods", "ar", "prompt_lookup",
                    "grpc:prompt_lookup", "grpc:draft_model")
    methods = report["methods"]
    assert list(methods) == ["ar", "prompt_lookup", "grpc:prompt_lookup", "grpc:draft_model", "grpc:ar"]
    for label in ("grpc:prompt_lookup", "grpc:draft_model", "grpc:ar"):
        assert methods[label]["greedy_match_ar"] == 1.0, label
        assert methods[label]["tau"] >= 1.0
    assert methods["grpc:prompt_lookup"]["tau"] == methods["prompt_lookup"]["tau"]
    assert methods["grpc:prompt_lookup"]["overhead_ms_per_step"] is not None
    assert methods["grpc:ar"]["speedup_vs_grpc_ar"]["median"] == 1.0
    assert report["config"]["server"].startswith("127.0.0.1:")


def test_bench_load_mode_batches_and_matches_ar(pair, tmp_path, capsys):
    """--concurrency: every level's greedy outputs equal ar's, the verifier really batched at N > 1, and the
    report has a row per method and level (HF methods skipped: they do not batch across requests)."""
    report = _bench(pair, tmp_path / "load.json", "--methods", "ar", "prompt_lookup", "hf_ar",
                    "--concurrency", "1", "3", "--max-new-tokens", "10")
    load = report["load"]
    assert load["levels"] == [1, 3] and load["skipped"] == ["hf_ar"]
    assert [(r["method"], r["concurrency"]) for r in load["rows"]] == [
        ("ar", 1), ("ar", 3), ("prompt_lookup", 1), ("prompt_lookup", 3)]
    num_prompts = report["config"]["num_prompts"]
    for row in load["rows"]:
        assert row["greedy_match_ar"] == 1.0 and row["requests"] == num_prompts
        assert row["tokens_per_s"] > 0 and row["itl_p50_ms"] > 0 and row["tau"] >= 1
        # a step split into the verifier's part and the rest: together the level's wall time
        steps = row["verifier_steps"]
        assert steps * row["mean_batch"] >= (row["tokens"] - row["requests"]) / row["tau"]  # every request's steps
        # over the decode steps (prefill-only forwards left out) every request decoding stepped (issue 67): the
        # batch there is the requests decoding, and what mean_batch lacks of N is the load's shape
        assert 0 < row["decode_steps"] < steps and row["stepped_per_running"] == 1.0
        assert row["decode_mean_batch"] == pytest.approx(row["mean_running"]) and row["decode_mean_batch"] > row["mean_batch"]
        assert row["mean_running"] <= row["concurrency"]
        # while the prompts last (the steps before the last prompt took a finished one's place): at N = 3 of 3
        # prompts there is no such phase
        if row["concurrency"] < num_prompts:
            assert 0 < row["steady_decode_steps"] < row["decode_steps"] and row["steady_stepped_per_running"] == 1.0
            assert row["steady_mean_running"] <= row["concurrency"]
        else:
            assert "steady_decode_steps" not in row
        assert 0 < row["verifier_step_ms"] and 0 <= row["host_ms_per_step"]
        # the step's host work until its one copy and its wait in it: parts of the verifier's step
        assert 0 < row["verifier_queue_ms"] and 0 <= row["verifier_copy_ms"]
        assert row["verifier_queue_ms"] + row["verifier_copy_ms"] <= row["verifier_step_ms"]
        total = (row["verifier_step_ms"] + row["host_ms_per_step"]) * steps
        assert total == pytest.approx(1e3 * row["wall_s"], rel=1e-9)
        assert not any(key.startswith("graph_") for key in row)  # CPU, no graphs: no graph counts
        drafts = row["method"] != "ar"
        assert (row["draft_ms_per_step"] > 0) == drafts and row["draft_ms_per_step"] >= 0
    assert max(r["mean_batch"] for r in load["rows"] if r["concurrency"] == 3) > 1.2
    out = capsys.readouterr().out
    assert "× ar" in out and "stepped ÷ running" in out


def test_bench_load_ignore_eos_generates_every_token(pair, tmp_path):
    """--ignore-eos (load mode): every request generates its max_new_tokens past EOS, as vllm_peer.py's do. Here a
    copy of the target names every token but 0 an end-of-sequence token, so without the flag each request ends at
    its first token; the per-prompt comparison refuses the flag (its HF peers stop at EOS)."""
    import shutil

    eos_pair = tmp_path / "pair"
    shutil.copytree(pair, eos_pair)
    for name in ("config.json", "generation_config.json"):
        path = eos_pair / "target" / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = list(range(1, config.get("vocab_size", 300)))
        path.write_text(json.dumps(config))
    tokens = {}
    for flag in ((), ("--ignore-eos",)):
        report = _bench(eos_pair, tmp_path / "load.json", "--methods", "ar", "prompt_lookup", "--concurrency", "2",
                        "--max-new-tokens", "6", *flag)
        assert report["config"]["sampling"]["ignore_eos"] is bool(flag)
        tokens[bool(flag)] = {r["method"]: (r["tokens"], r["requests"]) for r in report["load"]["rows"]}
    for method in ("ar", "prompt_lookup"):
        assert tokens[False][method] == (tokens[False][method][1], len(PROMPTS))  # one token each, then EOS
        assert tokens[True][method] == (6 * len(PROMPTS), len(PROMPTS))
    with pytest.raises(SystemExit, match="specmesh bench: --ignore-eos applies to load mode"):
        _bench(pair, tmp_path / "out.json", "--methods", "ar", "--ignore-eos")


def test_bench_load_prefix_cache_counted_and_off_on_request(pair, tmp_path):
    """The prompts repeat at every level: a later level finds them in the verifier's prefix cache (counted per
    row), unless --no-prefix-caching, which every level then prefills in full, with the same outputs."""
    rows = {}
    for flag in ((), ("--no-prefix-caching",)):
        report = _bench(pair, tmp_path / "load.json", "--methods", "ar", "--concurrency", "1", "2",
                        "--max-new-tokens", "4", *flag)
        assert report["config"]["prefix_caching"] is not bool(flag)
        rows[bool(flag)] = report["load"]["rows"]
    assert rows[False][1]["prefix_cache_hit_tokens"] > 0  # level 2: the prompts level 1 ran
    assert all(row["prefix_cache_hit_tokens"] == 0 for row in rows[True])
    assert all(row["greedy_match_ar"] == 1.0 for row in rows[True])


def test_bench_load_profile_records_the_engine_threads(pair, tmp_path):
    """--profile: one operator table per method and level, with the forwards the engine core ran on its own
    thread (not only the bench's main thread, which only waits)."""
    _bench(pair, tmp_path / "load.json", "--methods", "ar", "--concurrency", "2", "--max-new-tokens", "4",
           "--profile", str(tmp_path / "prof"))
    table = (tmp_path / "prof" / "ar_x2.txt").read_text()
    assert table.startswith("# ar_x2: operators by self CPU time") and "aten::mm" in table
