"""train-pair end to end on a tiny generated corpus: saved dirs load with Auto*, share one
tokenizer, round-trip text exactly, and the models learn something (held-out loss < uniform)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specmesh_app.train_pair import (
    ModelSize,
    TrainPairConfig,
    add_arguments,
    collect_files,
    config_from_args,
    lr_at,
    sample_batch,
    train_pair,
)

VOCAB_SIZE = 320


def _write_corpus(root: Path, num_files: int = 12) -> None:
    """Python-like files with shared structure, so a few steps are enough to beat the uniform loss."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "tests").mkdir()
    (root / "pkg" / "tests" / "skipped.py").write_text("SHOULD_NOT_BE_READ = 1\n" * 500)
    for i in range(num_files):
        funcs = []
        for j in range(8):
            funcs.append(
                f"def func_{i}_{j}(x, y={j}):\n"
                f'    """Return x plus {j}."""\n'
                f"    if x is None:\n"
                f"        return y\n"
                f"    for k in range({j + 1}):\n"
                f"        x = x + k * {i}\n"
                f"    return x + y\n"
            )
        body = f"import os\nimport sys\n\n\nclass Thing{i}:\n    value = {i}\n\n\n" + "\n\n".join(funcs)
        (root / "pkg" / f"mod_{i}.py").write_text(body)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("train_pair")
    _write_corpus(root / "corpus")
    cfg = TrainPairConfig(
        out_dir=root / "out",
        corpus=(root / "corpus",),
        vocab_size=VOCAB_SIZE,
        seq_len=32,
        target=ModelSize(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        draft=ModelSize(hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32),
        max_position_embeddings=64,
        target_minutes=1.0,
        draft_minutes=1.0,
        max_steps=20,
        batch_size=8,
        lr=1e-2,
        warmup_steps=2,
        heldout_fraction=0.1,
        threads=1,
    )
    return cfg.out_dir, train_pair(cfg)


def test_report_written_and_models_learned(trained):
    out, report = trained
    assert json.loads((out / "report.json").read_text()) == report
    for name in ("target", "draft"):
        loss = report[name]["heldout_loss"]
        assert math.isfinite(loss)
        assert loss < math.log(VOCAB_SIZE), (name, loss)
        assert report[name]["steps"] == 20
    assert report["target"]["params"] > report["draft"]["params"]
    assert 0.0 <= report["heldout_top1_agreement"] <= 1.0


def test_dirs_load_with_auto_classes_and_share_tokenizer(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained
    assert (out / "target" / "tokenizer.json").read_bytes() == (out / "draft" / "tokenizer.json").read_bytes()
    text = "def f(x):\n    return x + 1  # ünïcode → ok\n\n\tclass A: pass"
    for name in ("target", "draft"):
        tokenizer = AutoTokenizer.from_pretrained(out / name)
        assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == 0
        assert len(tokenizer) == VOCAB_SIZE
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text

        model = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32)
        assert model.config.vocab_size == VOCAB_SIZE
        assert model.config.tie_word_embeddings
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits  # [1, T, vocab]
        assert logits.shape == (1, len(ids), VOCAB_SIZE)
        assert torch.isfinite(logits).all()
        safetensors_files = list((out / name).glob("*.safetensors"))
        assert safetensors_files


def test_collect_files_skips_test_dirs(tmp_path):
    _write_corpus(tmp_path)
    (tmp_path / "pkg" / "test_thing.py").write_text("x = 1\n")
    files = collect_files((tmp_path, tmp_path / "pkg" / "mod_0.py"))
    assert [f.name for f in files] == sorted(f"mod_{i}.py" for i in range(12))


def test_sample_batch_labels_are_inputs_shifted_by_one():
    tokens = np.arange(100, dtype=np.uint16)
    inputs, labels = sample_batch(tokens, batch_size=5, seq_len=16, rng=np.random.default_rng(0))
    assert inputs.shape == labels.shape == (5, 16) and inputs.dtype == torch.int64
    assert torch.equal(labels, inputs + 1)
    assert int(labels.max()) <= 99


def test_lr_schedule_warms_up_then_decays():
    assert lr_at(0, 0.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 0.5, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert lr_at(10, 1.0, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_cli_arguments_map_to_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--out",
            str(tmp_path),
            "--corpus",
            "a.py",
            "b",
            "--vocab-size",
            "512",
            "--max-steps",
            "7",
            "--threads",
            "1",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.out_dir == tmp_path
    assert cfg.corpus == (Path("a.py"), Path("b"))
    assert (cfg.vocab_size, cfg.max_steps, cfg.threads) == (512, 7, 1)
    default = config_from_args(parser.parse_args(["--out", str(tmp_path)]))
    assert default.corpus == () and default.max_steps is None
    for action in parser._actions:
        assert action.help, action.dest
