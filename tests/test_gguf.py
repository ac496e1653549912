"""A .gguf target: dequantized once into a cached Hugging Face directory named by the file's hash, with the
file's tokenizer and chat template; the same model as the checkpoint it was written from; served over the
OpenAI API under its file name. The GGUF is written here, from the bundled demo target (F32 tensors, so the
round trip is exact)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specmesh import models
from tests.service_helpers import TARGET, wait_until
from tests.test_http_api import free_port, post

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install 'specmesh[gguf]'")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
LAYER_NAMES = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight"}


def write_gguf(source: Path, out: Path) -> Path:
    """``source`` (a Llama checkpoint with a byte-level BPE tokenizer) as llama.cpp writes it: its metadata
    keys, tensor names, and Q/K rows in llama.cpp's rotary order."""
    cfg = json.loads((source / "config.json").read_text())
    tok = json.loads((source / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens = [""] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(TEMPLATE)

    def rotary_order(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    for name, t in load_file(source / "model.safetensors").items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif name == "model.norm.weight":
            name = "output_norm.weight"
        elif name == "lm_head.weight":
            name = "output.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            name = f"blk.{layer}.{LAYER_NAMES[rest]}"
            if rest.startswith("self_attn.q_proj"):
                t = rotary_order(t, cfg["num_attention_heads"])
            elif rest.startswith("self_attn.k_proj"):
                t = rotary_order(t, cfg["num_key_value_heads"])
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(Path(TARGET), tmp_path_factory.mktemp("gguf") / "demo.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(models.GGUF_CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_dequantizes_once_into_the_same_model(gguf_file, cache, capsys):
    directory = models.model_dir(gguf_file)
    assert directory.parent == cache and "dequantizing" in capsys.readouterr().err
    original, converted = load_file(Path(TARGET) / "model.safetensors"), load_file(directory / "model.safetensors")
    assert set(converted) == set(original)  # tied embeddings stay tied
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor.float()), name  # F32 tensors: float32, exact
    assert json.loads((directory / "config.json").read_text())["dtype"] == "float32"
    text = "def fibonacci(n):\n    return n * 2  # héllo\n"
    assert models.load_tokenizer(directory).encode(text) == models.load_tokenizer(TARGET).encode(text)
    assert (directory / "chat_template.jinja").read_text() == TEMPLATE
    assert models.model_dir(gguf_file) == directory and "dequantizing" not in capsys.readouterr().err
    os.utime(gguf_file)  # touched, same bytes: hashed again, the same directory
    assert models.model_dir(gguf_file) == directory and "dequantizing" not in capsys.readouterr().err


def test_without_the_gguf_package_it_is_one_clear_line(gguf_file, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ValueError, match=r"pip install 'specmesh\[gguf\]'"):
        models.model_dir(gguf_file)


def test_serve_a_gguf_answers_chat_with_its_own_template(gguf_file, cache, tmp_path):  # named as given, as vLLM does
    port, ready = free_port(), tmp_path / "ready"
    env = {**os.environ, models.GGUF_CACHE: str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "specmesh", "serve", str(gguf_file), "--port", str(port),
                             "--threads", "1", "--ready-file", str(ready)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 180)
        url = f"http://127.0.0.1:{port}"
        message = [{"role": "user", "content": "def fibonacci(n):"}]
        status, answer = post(url + "/v1/chat/completions", {"model": str(gguf_file), "max_tokens": 12,
                                                             "temperature": 0, "messages": message})
        assert status == 200, answer
        status, plain = post(url + "/v1/completions", {"model": str(gguf_file), "max_tokens": 12, "temperature": 0,
                                                       "prompt": "def fibonacci(n):\n"})  # the template's render
        assert status == 200 and answer["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "Traceback" not in out, out


def test_greedy_output_of_the_gguf_is_the_checkpoint_s(gguf_file, cache):
    def run(target: str) -> list[int]:
        done = subprocess.run([sys.executable, "-m", "specmesh", "generate", "def fibonacci(n):", "--target", target,
                               "--proposer", "none", "--max-new-tokens", "24", "--json"], capture_output=True,
                              text=True, timeout=180, env={**os.environ, models.GGUF_CACHE: str(cache)}, check=True)
        return json.loads(done.stdout)["token_ids"]

    assert run(str(gguf_file)) == run(str(TARGET))
