"""Reading a Llama-family checkpoint (config.json + safetensors) without transformers.

Importing transformers' modelling code costs a command several seconds before it does anything (its fp8 and
sharding integrations pull in ``torch._dynamo`` and ``torch.distributed.tensor``). The fast runner needs
none of it: its forward is its own, on the checkpoint's tensors. ``fast_reason`` says whether a directory
can be read this way *exactly as transformers would load it*: every field whose transformers default we
would otherwise have to guess is present in config.json, the tensor names are exactly the ones the
architecture has (biases included), and the rotary embedding is one whose tables we compute here
(``inv_freq``: the same float32 formulas as ``transformers.modeling_rope_utils``; tests compare them).
Any other directory is loaded through transformers (``specmesh.models.load_runner``), as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# fields transformers fills with a per-architecture default when config.json lacks them
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "vocab_size",
            "max_position_embeddings", "tie_word_embeddings", "eos_token_id")
ROPE_TYPES = ("default", "linear", "llama3")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def rope_parameters(config: dict) -> dict:
    """The rotary embedding's parameters in transformers 5's shape (``rope_parameters``), from either that
    field or the older ``rope_theta`` + ``rope_scaling``; {} when the theta is missing."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    if not params:
        params = dict(scaling)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        if "rope_theta" in config:
            params["rope_theta"] = config["rope_theta"]
    params.setdefault("rope_type", "default")
    return params if "rope_theta" in params else {}


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def bias_projections(config: dict) -> tuple[str, ...]:
    """The attention projections that carry a bias in this architecture."""
    if config["model_type"] == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    if config["model_type"] == "llama" and config.get("attention_bias", False):
        return ("q_proj", "k_proj", "v_proj", "o_proj")
    return ()


def expected_names(config: dict, with_lm_head: bool) -> set[str]:
    """The tensor names a checkpoint of this config holds."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if with_lm_head else set())
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        names |= {layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"}
        names |= {f"{layer}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        names |= {f"{layer}self_attn.{p}.bias" for p in bias_projections(config)}
        names |= {f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    return names


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (sharded through the index, or the one file); [] if none."""
    if (path / INDEX_FILE).is_file():
        shards = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    return [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else []


def tensor_names(files: list[Path]) -> set[str]:
    """Names of the tensors in ``files``, from their headers (no tensor is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return {n for n in names if not n.endswith("rotary_emb.inv_freq")}


def config_reason(config: dict) -> str | None:
    """None if config.json alone says the checkpoint reads exactly without transformers, else why not."""
    if config.get("model_type") not in SUPPORTED_TYPES:
        return f"model_type {config.get('model_type')!r} is not one of {list(SUPPORTED_TYPES)}"
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        return f"config.json leaves {', '.join(missing)} to transformers' defaults"
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        return "not a SiLU MLP without biases"
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and window < config["max_position_embeddings"]:
        return "sliding-window attention"
    rope = rope_parameters(config)
    if not rope:
        return "no rope_theta in config.json"
    if rope["rope_type"] not in ROPE_TYPES or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"rope_type {rope['rope_type']!r} (tables computed here: {', '.join(ROPE_TYPES)})"
    if config.get("quantization_config"):
        return "a quantized checkpoint"
    return None


def fast_reason(path: Path) -> str | None:
    """None if the checkpoint in ``path`` can be read without transformers, exactly as transformers reads it;
    else the reason (the caller then loads it through transformers)."""
    config = read_config(path)
    reason = config_reason(config)
    if reason is not None:
        return reason
    files = weight_files(path)
    if not files:
        return "no safetensors weights"
    names = tensor_names(files)
    tied = bool(config["tie_word_embeddings"])
    # tied: the output layer is the embedding (a stored lm_head is ignored, as transformers ties it over)
    wanted = expected_names(config, with_lm_head=not tied)
    if names - {"lm_head.weight"} != wanted - {"lm_head.weight"} or (not tied and "lm_head.weight" not in names):
        return "its tensor names are not the ones this architecture has"
    return None


def load_tensors(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to ``dtype`` on ``device``."""
    from safetensors import safe_open

    out = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


def inv_freq(config: dict) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of the rotary embedding (default, linear and llama3 types),
    computed as transformers computes them."""
    import torch

    rope = rope_parameters(config)
    dim = head_dim(config)
    freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope["rope_type"] == "linear":
        return freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope_tables(config: dict, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position_embeddings, head_dim] in ``dtype``, as transformers' rotary embedding gives them."""
    import torch

    positions = torch.arange(config["max_position_embeddings"], device=device)
    freqs = positions[:, None].float() * inv_freq(config).to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
