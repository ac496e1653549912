"""serve's torch-free tokenizer gives exactly transformers' ids and text on the bundled vocabularies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specmesh.models import demo_model, load_tokenizer
from specmesh.text_tokenizer import TextTokenizer, load_text_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "stdlib-code" / "target"
DIRS = [demo_model("target")] + ([SHARED] if (SHARED / "tokenizer.json").is_file() else [])
TEXTS = ["def fibonacci(n):", "", "  \n\t x", "import os\nimport sys\n\n\nclass A:\n    pass\n", "é 漢字 🙂",
         "<|endoftext|>print('hi')<|endoftext|>", "a" * 500]


@pytest.mark.parametrize("path", DIRS, ids=[p.parent.name + "/" + p.name for p in DIRS])
def test_same_ids_and_text_as_transformers(path):
    light, full = load_text_tokenizer(path), load_tokenizer(path)
    assert isinstance(light, TextTokenizer)
    rng = random.Random(0)
    vocab = len(full.get_vocab())
    texts = TEXTS + [Path(__file__).read_text()[rng.randrange(3000):][:rng.randrange(1, 400)] for _ in range(30)]
    for text in texts:
        assert light.encode(text) == full.encode(text), text
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)


def test_other_tokenizers_go_through_transformers(tmp_path):
    src = demo_model("target")
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_text_tokenizer(tmp_path), TextTokenizer)


def test_loading_it_loads_no_model_stack():
    import subprocess
    import sys

    code = ("import sys; from specmesh.models import demo_model; from specmesh.text_tokenizer import load_text_tokenizer; "
            "load_text_tokenizer(demo_model('target')).encode('x = 1'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
