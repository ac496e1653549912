"""`specmesh train-cllm` (specmesh_app/train_cllm.py) on a tiny random model: Jacobi trajectories end at the
greedy continuation, Jacobi decoding reproduces it, training lowers its own objective, and the command saves
a loadable model directory that says what it is."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specmesh.models import demo_model
from specmesh_app import cli
from specmesh_app.train_cllm import CllmConfig, Example, cllm_loss, collect, jacobi_decode, jacobi_trajectory
from tests.spec_helpers import naive_greedy, tiny_llama

VOCAB = 4096  # the bundled demo tokenizer's


def tiny(seed: int = 0):
    return tiny_llama(seed, vocab=VOCAB, hidden=32, heads=2, kv_heads=1, intermediate=64, layers=2).float()


def test_a_jacobi_trajectory_ends_at_the_greedy_continuation():
    model = tiny()
    rng = np.random.default_rng(0)
    for _ in range(3):
        context = torch.as_tensor(rng.integers(VOCAB, size=12))
        init = torch.as_tensor(rng.integers(VOCAB, size=8))
        states, fixed = jacobi_trajectory(model, context, init)
        assert fixed.tolist() == naive_greedy(model, context.tolist(), 8)
        assert len(states) <= 8  # each iteration fixes at least one more leading position
        if states:
            assert torch.equal(states[0], init)


def test_jacobi_decoding_reproduces_greedy_decoding():
    model = tiny(1)
    rng = np.random.default_rng(1)
    context = torch.as_tensor(rng.integers(VOCAB, size=10))
    tokens, forwards = jacobi_decode(model, context, 6, 20, rng)
    assert tokens == naive_greedy(model, context.tolist(), 20)
    assert 1 <= forwards <= 20


def cllm_objective(model, examples, ar_weight: float) -> float:
    with torch.no_grad():
        _, consistency, ar = cllm_loss(model, examples, np.random.default_rng(9), ar_weight)
    return consistency + ar_weight * ar


def test_training_lowers_its_objective():
    """Trained on a few trajectories, the model lowers the loss it is trained on; with the consistency loss
    alone, trajectory states come to predict what the fixed point predicts."""
    for ar_weight in (1.0, 0.0):
        model = tiny(2)
        rng = np.random.default_rng(2)
        contexts = [rng.integers(VOCAB, size=10).tolist() for _ in range(6)]
        cfg = CllmConfig(base=demo_model("target"), out_dir=None, corpus=(), block=6, prompt_len=10, num_prompts=6)
        examples: list[Example] = collect(model, contexts, cfg, rng)
        assert examples and all(len(e.states) >= 1 for e in examples)

        before = cllm_objective(model, examples, ar_weight)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(40):
            loss, _, _ = cllm_loss(model, examples, rng, ar_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert cllm_objective(model, examples, ar_weight) < 0.5 * before, ar_weight


def test_the_command_saves_a_labelled_loadable_model(tmp_path, capsys):
    base = tmp_path / "base"
    tiny(3).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model("target") / name, base / name)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40)))
    out = tmp_path / "base-cllm"
    assert cli.main(["train-cllm", "--base", str(base), "--out", str(out), str(corpus), "--block", "6",
                     "--prompt-len", "24", "--num-prompts", "6", "--max-steps", "5", "--batch-size", "2",
                     "--checkpoint-every", "2"]) == 0
    report = json.loads((out / "cllm.json").read_text())
    assert report["kind"] == "cllm" and report["base"] == str(base) and report["steps"] == 5
    assert set(report["before"]) == set(report["after"]) == {"heldout_loss", "jacobi_tokens_per_step"}
    assert not (out / "checkpoint.pt").exists()  # removed once the model is saved
    AutoModelForCausalLM.from_pretrained(out)  # a model directory any loader takes
    assert (out / "tokenizer.json").is_file()
    assert "Jacobi tokens per step" in capsys.readouterr().out


def test_the_ar_loss_reads_the_corpus_text_after_each_context():
    """With ar_on="corpus" (the default) an example keeps the corpus window as long as its context + block: the
    AR loss is on ground truth, not on the base model's own fixed point; ar_on="model" keeps none."""
    model = tiny(4)
    rng = np.random.default_rng(4)
    windows = [rng.integers(VOCAB, size=10 + 2 * 6).tolist() for _ in range(4)]  # context + 2 blocks of text
    for ar_on in ("corpus", "model"):
        cfg = CllmConfig(base=demo_model("target"), out_dir=None, corpus=(), block=6, prompt_len=10, num_prompts=4,
                         ar_on=ar_on)
        assert cfg.window_len == 22
        examples = collect(model, windows, cfg, np.random.default_rng(5))
        assert examples
        for ex in examples:
            window = next(w for w in windows if w[:10] == ex.context[:10].tolist())
            if ar_on == "corpus":
                assert ex.truth.tolist() == window[: ex.context.shape[0] + 6]
            else:
                assert ex.truth is None
        loss, consistency, ar = cllm_loss(model, examples, np.random.default_rng(6), 1.0)
        assert np.isfinite(loss.item()) and consistency >= 0 and ar > 0
    with pytest.raises(ValueError):
        CllmConfig(base=demo_model("target"), out_dir=None, corpus=(), ar_on="both")
