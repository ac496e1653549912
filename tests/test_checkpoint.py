"""A Llama-family checkpoint read without transformers is the model transformers loads: same weights, same rotary
tables, bitwise the same logits; anything it cannot read exactly goes through transformers; and the
embedded commands no longer import transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from specmesh import checkpoint, models
from specmesh.fast_llama import FastLlamaRunner
from specmesh.model_runner import tree_attend_mask

SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, initializer_range=0.3, eos_token_id=3)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**SHAPE, num_key_value_heads=4, tie_word_embeddings=True),
    "llama-gqa-bias": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False,
                                          attention_bias=True),
    "llama-linear": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3-rope": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                                       rope_parameters=LLAMA3),
    "qwen2-bias": lambda: Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False,
                                      use_sliding_window=False),
    "mistral": lambda: MistralConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None),
}


def _save(config, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory) -> Path:
    return _save(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def test_checkpoint_runner_is_the_transformers_model(saved: Path) -> None:
    assert checkpoint.fast_reason(saved) is None
    for dtype in (torch.float32, torch.bfloat16):
        light = models.load_runner(saved, dtype)
        module = models.load_runner(saved, dtype, hf_module=True)
        assert light.model is None and module.model is not None
        assert isinstance(light, FastLlamaRunner) and isinstance(module, FastLlamaRunner)
        assert light.info == module.info
        assert torch.equal(light.cos, module.cos) and torch.equal(light.sin, module.sin)
        c_light, c_module = light.new_cache(), module.new_cache()
        prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2))
        assert torch.equal(light.forward(c_light, prompt, range(40)), module.forward(c_module, prompt, range(40)))
        ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)  # a small tree step
        attend = tree_attend_mask(40, ancestors)
        assert torch.equal(light.forward(c_light, [5, 6, 7], [40, 41, 40], attend),
                           module.forward(c_module, [5, 6, 7], [40, 41, 40], attend))


def test_inv_freq_is_transformers_own() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("llama-linear", "llama3-rope"):
        config = CONFIGS[name]()
        theirs, scaling = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")
        assert scaling == 1.0
        assert torch.equal(checkpoint.inv_freq(config.to_dict()), theirs), name


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change, reason", [
    ({"eos_token_id": None}, "defaults"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "SiLU"),
    ({"model_type": "gpt2"}, "model_type"),
])
def test_what_it_cannot_read_exactly_goes_through_transformers(tmp_path: Path, change: dict, reason: str) -> None:
    path = _save(CONFIGS["llama-tied"](), tmp_path)
    _edit_config(path, **change)
    assert reason in checkpoint.fast_reason(path)
    if change.get("model_type") != "gpt2":  # a real llama config otherwise: transformers loads it
        runner = models.load_runner(path, torch.float32)
        assert runner.model is not None
    with pytest.raises(ValueError, match="cannot be read without transformers"):
        FastLlamaRunner.from_checkpoint(path)


def test_unexpected_tensor_names_go_through_transformers(tmp_path: Path) -> None:
    path = _save(CONFIGS["llama-gqa-bias"](), tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.o_proj.bias"},
              path / "model.safetensors", metadata={"format": "pt"})
    assert "tensor names" in checkpoint.fast_reason(path)


def _imports_transformers(code: str) -> bool:
    """Whether ``code``, run in a fresh interpreter, leaves transformers imported."""
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}print('transformers' in sys.modules)\n"],
                         capture_output=True, text=True, timeout=120, check=True)
    last = out.stdout.strip().splitlines()[-1]
    assert last in ("True", "False"), out.stderr[-2000:]
    return last == "True"


def test_generate_runs_without_importing_transformers() -> None:
    """The README's run line loads the demo pair and its tokenizer without transformers (seconds of start-up)."""
    assert not _imports_transformers(
        "import contextlib, io\n"
        "from specmesh_app.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['generate', 'def f(n):', '--max-new-tokens', '8'])\n")


def test_a_drafter_starts_without_importing_transformers() -> None:
    """A drafter over the demo draft builds every proposer (the n-gram store's namespace is its vocabulary's
    fingerprint) without transformers: its tokenizer classes were 4 of a drafter's 10 seconds of start-up."""
    assert not _imports_transformers(
        "from specmesh_app.cli import build_parser\n"
        "from drafter_service.server import build_servicer\n"
        "build_servicer(build_parser().parse_args(['drafter', '--threads', '1']), None)\n")
