"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2), on the HF model's own weights.

Why: at the sizes speculative drafters run at, a Hugging Face forward spends most
of its time in framework overhead (mask construction, cache objects, module
dispatch), not in arithmetic; the 3.7M-parameter draft of the benchmark pair
takes ~3 ms per HF forward. This runner does the same math with fused QKV and
gate/up projections, a preallocated KV cache and precomputed rotary tables.
It is numerically the same model (tests compare its logits with the HF forward)
and exposes the ModelRunner interface, so everything else is unaware of it.

Models it cannot run exactly (other architectures, sliding windows, dynamic
rope scaling, non-SiLU MLPs) are refused by ``supports``; ``make_runner`` then
falls back to the generic Hugging Face runner.

This module is the model: its weights, the layers' math, the frozen stack (``--compile frozen``) and the
runner. Beside it: the attention backends (``sdpa_attention.py``, ``kernel_attention.py``), the CPU's layouts
and products (``cpu_platform.py``), the CUDA graphs of its steps (``cuda_graphs.py``) and its options
(``runner_options.py``).

Attention has two backends (``attention=``): ``sdpa``, PyTorch's scaled_dot_product_attention
per session under a dense mask (any device and dtype; ``sdpa_attention.py``), and ``triton``, the
fused tree-attention kernel (``kernels/tree_attention.py``, through ``kernel_attention.py``): every
session of a forward in one launch per layer, keys/values read from the paged pool through the
block tables, tree masks as ancestor bits (``TreeMask``). ``auto`` takes $SPECMESH_ATTENTION when
set, else the kernel for a CUDA model when triton imports, else SDPA. The kernel path needs all
caches of a forward in one pool and structured masks (``TreeMask`` or causal); a forward with a dense
mask tensor or sessions of several pools (``new_cache``s, each its own) runs SDPA.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specmesh import checkpoint, cpu_platform
from specmesh.contract import ModelInfo
from specmesh.cuda_graphs import PoolGraphs, graph_choice, relative_error
from specmesh.kernel_attention import KernelAttention, kernel_metadata
from specmesh.kv_pool import KVPool, PagedKVCache
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.runner_options import ATTENTION_BACKENDS, ATTENTION_ENV, COMPILE_ENV, COMPILE_MODES
from specmesh.sdpa_attention import SdpaAttention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
# how close the compiled layer must come to the eager one on the start-up probe, relative to the eager output's
# largest value (inductor fuses and reorders float32 arithmetic, and does not round intermediates as eager does:
# the norms run in float32 in every dtype, as in transformers)
COMPILE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
SUPPORTED_TYPES = set(checkpoint.SUPPORTED_TYPES)
STATIC_ROPE = {"default", "linear", "llama3", "yarn", "longrope"}


def supports(model: PreTrainedModel) -> str | None:
    """None if the fast path can run ``model`` exactly, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        if cfg.sliding_window < cfg.max_position_embeddings:
            return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} changes with sequence length"
    return None


def _share(linears: Sequence[torch.nn.Module], weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Make ``linears`` (stacked along their outputs) use slices of ``weight_t`` [in, sum of outs] and ``bias``
    as their parameters, views without a copy, so that the model's own weights can be freed."""
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight_t[:, start:end].t(), requires_grad=False)  # [out, in] view
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in LlamaRMSNorm's op order: normalise in float32, cast back, then scale. In float32 (no casts) it is
    torch's fused ``rms_norm``: one op for eight (on this project's CPU 20 against 31 µs a call, the same values);
    other dtypes keep the casts' rounding points (the fused op rounds once, and computes float64 in float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# One layer's dense work around attention, as two pure functions of the layer's weights: what ``--compile`` hands
# to torch.compile (one compilation serves every layer of a model; the attention between them stays eager, with
# its paged writes and kernel launch).
def _pre_attention(x: torch.Tensor, ln1, qkv_w, qkv_b, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> q [heads, T, head_dim], k and v [kv_heads, T, head_dim]: norm, fused QKV, rotary on q, k."""
    total, q_size, kv_size = x.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    qkv = cpu_platform.linear(_rms(x, ln1, eps), qkv_w, qkv_b)
    q = qkv[:, :q_size].view(total, num_heads, head_dim).transpose(0, 1)
    k = qkv[:, q_size : q_size + kv_size].view(total, num_kv_heads, head_dim).transpose(0, 1)
    v = qkv[:, q_size + kv_size :].view(total, num_kv_heads, head_dim).transpose(0, 1)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _post_attention(x: torch.Tensor, attn: torch.Tensor, o_w, o_b, ln2, gate_up, down, eps: float) -> torch.Tensor:
    """The residual stream after the output projection (attn: [T, heads * head_dim]) and the gated MLP."""
    x = x + cpu_platform.linear(attn, o_w, o_b)
    gate, up = cpu_platform.linear(_rms(x, ln2, eps), gate_up).chunk(2, dim=-1)
    return x + cpu_platform.linear(F.silu(gate) * up, down)


def attention_backend(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve ``choice`` (one of ATTENTION_BACKENDS) to ``sdpa`` or ``triton``: ``auto`` is $SPECMESH_ATTENTION
    when set, else the kernel for a CUDA model in a dtype it takes, when triton imports, else SDPA."""
    if choice == "auto":
        choice = os.environ.get(ATTENTION_ENV) or "auto"
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}; choose one of {ATTENTION_BACKENDS}")
    if choice != "auto":
        return choice
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not _cuda_with_triton(device):
        return "sdpa"
    return "triton"


def _cuda_with_triton(device: torch.device) -> bool:
    """A CUDA device, and triton imports (the kernel's and inductor's GPU code generator)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compile_choice(choice: str, device: torch.device) -> str:
    """Resolve ``compile_layers`` (one of COMPILE_MODES) to ``off``, ``on`` or ``frozen``. ``auto`` is
    $SPECMESH_COMPILE when set, else ``on`` for a CUDA model when triton imports (a layer's ~30 eager launches become
    ~10, and on a GPU the host's launches bound the step: benchmarks/results/gpu_h100.md) and ``off`` on the CPU
    (``on`` measured 0.86-0.97x there: hot_path.md; ``frozen`` pays there but compiles for minutes at start-up).
    ``frozen`` (the whole stack as one graph, weights as constants: ``_FrozenStack``) is the CPU's mode."""
    if choice == "auto":
        choice = os.environ.get(COMPILE_ENV) or "auto"
    if choice not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {choice!r}; choose one of {COMPILE_MODES}")
    if choice == "frozen" and device.type != "cpu":
        raise ValueError("compile mode 'frozen' is for a CPU model (inductor's C++ GEMM templates); on CUDA use 'on'")
    if choice != "auto":
        return choice
    return "on" if _cuda_with_triton(device) else "off"


# ------------------------------------------------------------------------------ the frozen stack (--compile frozen)
# On a CPU the step's few rows go through MKL's small-M GEMM, which runs near one row's speed per row (2 rows ~1.5x
# one, 4 rows ~2.3x): a verify step's tree costs almost a forward per few nodes. Inductor's C++ GEMM templates
# (max-autotune) run 2-16 rows at 1.3-1.6x that speed, but only on weights frozen into the graph as constants
# (they are packed at compile time): so the whole stack is one compiled module that owns its weights, and each
# layer's attention (paged writes, the step's masks: state the compiler must not see) is an opaque custom op
# that calls the forward's attention object, handed over per thread.
_FROZEN = threading.local()  # .attention: the attention of the frozen-stack forward running on this thread
_LAYER_FIELDS = ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up", "down")  # a layer tuple's order
FROZEN_OPTIONS = {  # inductor options of the frozen stack
    "freezing": True,  # weights become constants, packed for the GEMM templates
    "max_autotune": True,  # benchmark the C++ templates against ATen's GEMM per shape, at compile time
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,  # no autotuning tables on stderr
    "max_autotune_report_choices_stats": False,
}


@torch.library.custom_op("specmesh::layer_attention", mutates_args=())
def _layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [heads, T, head_dim], k/v [kv_heads, T, head_dim] -> [T, heads * head_dim]: layer ``layer``'s attention by
    the forward's own attention object (``_FROZEN.attention``), which also writes k and v into the caches."""
    return _FROZEN.attention(layer, q, k, v)


@_layer_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2])


class _LayerWeights(torch.nn.Module):
    """One layer's weights as parameters (views of the runner's; None where a bias is absent)."""

    def __init__(self, weights: Sequence[torch.Tensor | None]) -> None:
        super().__init__()
        for name, weight in zip(_LAYER_FIELDS, weights, strict=True):
            self.register_parameter(name, None if weight is None else torch.nn.Parameter(weight, requires_grad=False))


class _FrozenStack(torch.nn.Module):
    """Every layer of the runner over rows x [T, hidden] (embedded) with rotary tables cos/sin [T, head_dim] ->
    the last layer's output [T, hidden], attention through ``_layer_attention``."""

    def __init__(self, runner: FastLlamaRunner) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_LayerWeights(layer) for layer in runner.layers)
        self.shape = (runner.num_heads, runner.num_kv_heads, runner.head_dim)
        self.eps = runner.eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(self.layers):
            q, k, v = _pre_attention(x, w.ln1, w.qkv_w, w.qkv_b, cos, sin, self.eps, *self.shape)
            x = _post_attention(x, _layer_attention(q, k, v, i), w.o_w, w.o_b, w.ln2, w.gate_up, w.down, self.eps)
        return x


# ------------------------------------------------------------------------------------- runner
class FastLlamaRunner(ModelRunner):
    """The fast forward over a Llama-family model: built on a loaded transformers module (``FastLlamaRunner(model)``,
    whose parameters become views of the runner's weights) or straight from a checkpoint directory
    (``from_checkpoint``: no transformers import, ``self.model`` is None)."""

    def __init__(self, model: PreTrainedModel, attention: str = "auto", compile_layers: str = "auto",
                 cuda_graphs: str = "auto") -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the fast runner cannot run this model: {reason}")
        self._adopt(model)  # not ModelRunner.__init__: the pool's shape is the runner's own, not probed
        cfg = model.config
        inner = model.model
        # The runner's own layout of the weights ([in, out], fused QKV and gate/up) is the only copy kept: the
        # HF module's parameters become views into it (``_share``), so its forward (the HF peers of `bench`)
        # still runs, on the same numbers, without a second copy of the model in memory. (In float32 on a CPU
        # the output layer has one more copy, in column blocks: ``cpu_platform.head_blocks``.)
        head = model.get_output_embeddings()
        tied = head.weight is inner.embed_tokens.weight
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            projections = (att.q_proj, att.k_proj, att.v_proj)
            qkv_w = cpu_platform.in_out_layout(torch.cat([p.weight for p in projections]))
            qkv_b = None
            if att.q_proj.bias is not None:
                qkv_b = torch.cat([p.bias for p in projections]).detach().contiguous()
            gate_up = cpu_platform.in_out_layout(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            o_w, down = (cpu_platform.in_out_layout(p.weight) for p in (att.o_proj, mlp.down_proj))
            _share(projections, qkv_w, qkv_b)
            _share((mlp.gate_proj, mlp.up_proj), gate_up)
            _share((att.o_proj,), o_w)
            _share((mlp.down_proj,), down)
            self.layers.append((layer.input_layernorm.weight, qkv_w, qkv_b, o_w, att.o_proj.bias,
                                layer.post_attention_layernorm.weight, gate_up, down))
        self.norm = inner.norm.weight
        self.lm_head = cpu_platform.in_out_layout(head.weight)  # [hidden, vocab]
        self.lm_head_bias = getattr(head, "bias", None)
        _share((head,), self.lm_head)
        # tied embeddings: the table is the output layer's, read by column ([hidden, vocab]); else its own rows
        self.embed = None if tied else inner.embed_tokens.weight  # [vocab, hidden]
        if tied:
            inner.embed_tokens.weight = head.weight
        with torch.inference_mode():
            positions = torch.arange(self.info.max_positions, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)  # [1, max_positions, head_dim]
        self._setup(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None),
                    getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.rms_norm_eps,
                    cos[0], sin[0], attention, compile_layers, cuda_graphs)

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        attention: str = "auto", compile_layers: str = "auto",
                        cuda_graphs: str = "auto") -> FastLlamaRunner:
        """The runner over the checkpoint in ``path`` read without transformers: config.json and safetensors,
        exactly the weights and rotary tables transformers would load (``checkpoint.fast_reason`` must be
        None, else ValueError with the reason). ``self.model`` is None: there is no transformers module."""
        path = Path(path)
        reason = checkpoint.fast_reason(path)
        if reason is not None:
            raise ValueError(f"{path} cannot be read without transformers: {reason}")
        device = torch.device(device)
        cfg = checkpoint.read_config(path)
        tensors = checkpoint.load_tensors(path, dtype, device)
        self = cls.__new__(cls)  # the ModelRunner fields without a module (ModelRunner.__init__ reads one)
        self.model, self.dtype, self.device = None, dtype, device
        eos = cfg["eos_token_id"] if cfg["eos_token_id"] is not None else ()
        embed = tensors.pop("model.embed_tokens.weight")  # [vocab, hidden]
        head = embed if cfg["tie_word_embeddings"] else tensors.pop("lm_head.weight")
        self.info = ModelInfo(vocab_size=int(head.shape[0]), max_positions=int(cfg["max_position_embeddings"]),
                              eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos))
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            def take(name: str, layer: str = f"model.layers.{i}.") -> torch.Tensor | None:
                """A tensor of this layer, let go of by the dict as it is fused (the peak stays one layer's)."""
                return tensors.pop(layer + name, None)

            att = [f"self_attn.{p}_proj" for p in "qkv"]
            biases = [take(p + ".bias") for p in att]
            layout = cpu_platform.in_out_layout
            self.layers.append((take("input_layernorm.weight"), layout(torch.cat([take(p + ".weight") for p in att])),
                                None if biases[0] is None else torch.cat(biases),
                                layout(take("self_attn.o_proj.weight")), take("self_attn.o_proj.bias"),
                                take("post_attention_layernorm.weight"),
                                layout(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])),
                                layout(take("mlp.down_proj.weight"))))
        self.norm = tensors["model.norm.weight"]
        self.lm_head, self.lm_head_bias = cpu_platform.in_out_layout(head), None  # [hidden, vocab]
        self.embed = None if cfg["tie_word_embeddings"] else embed
        del embed, head  # the fused copies are kept; every layer's tensor has left ``tensors`` already
        with torch.inference_mode():
            cos, sin = checkpoint.rope_tables(cfg, dtype, device)
        self._setup(cfg["num_attention_heads"], cfg.get("num_key_value_heads"), checkpoint.head_dim(cfg),
                    cfg["rms_norm_eps"], cos, sin, attention, compile_layers, cuda_graphs)
        return self

    def _setup(self, num_heads: int, num_kv_heads: int | None, head_dim: int, eps: float, cos: torch.Tensor,
               sin: torch.Tensor, attention: str, compile_layers: str = "auto", cuda_graphs: str = "auto") -> None:
        """What both constructors share, once the weights are in place; cos/sin: [max_positions, head_dim]."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim
        self.paged_shape = (len(self.layers), self.num_kv_heads, head_dim)  # of its pools
        self.eps = eps
        self.cos, self.sin = cos, sin
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.attention = attention_backend(attention, self.device, self.dtype)
        # the output layer in column blocks, for products of 2+ rows (a verify step's trees, a batch): float32 on
        # a CPU only, where it was measured to pay (one more copy of the output layer's weights)
        cpu_float32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.head_blocks = cpu_platform.head_blocks(self.lm_head, cpu_platform.HEAD_BLOCK) if cpu_float32 else None
        mode = compile_choice(compile_layers, self.device)
        # bf16 products on oneDNN-packed weights where the CPU multiplies bf16 natively (``cpu_platform.pack_weights``);
        # not under --compile frozen, whose stack packs its own
        weights = [w for _, qkv_w, _, o_w, _, _, gate_up, down in self.layers for w in (qkv_w, o_w, gate_up, down)]
        self.packed = mode != "frozen" and cpu_platform.packs_products(self.device, self.dtype) and (
            cpu_platform.pack_weights(weights + [self.lm_head]))
        # float32 copies of the layers' and the output layer's weights where some products run through float32
        # (``cpu_platform.keep_float32_copies``); not under --compile on, whose compiled layers multiply in the
        # weights' own dtype
        self.float32_copies = mode != "on" and cpu_platform.upcasts_products(self.device, self.dtype) and (
            cpu_platform.keep_float32_copies(weights + [self.lm_head]))
        self._kernels = self._load_kernels() if self.attention == "triton" else None
        if self._kernels is not None and self.device.type == "cuda":
            t0 = time.perf_counter()
            n = self._kernels.compile_variants(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device)
            log.info("tree-attention kernel: %d variants compiled in %.1f s", n, time.perf_counter() - t0)
        # split-KV when a launch has fewer programs than the GPU has SMs (kernels.tree_attention.kv_splits)
        self._num_sms = None
        if self._kernels is not None and self.device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._dense = (_pre_attention, _post_attention)  # a layer's work before and after attention
        self._stack = None  # the compiled frozen stack (--compile frozen), which then runs every layer
        if mode == "on":
            self._dense = self._compiled_dense(required=compile_layers == "on")
        # CUDA graphs of the kernel path's steps, per paged pool (cuda_graphs.py): "on", "auto" or None (off)
        self._graph_mode = graph_choice(cuda_graphs, self.device, self.attention)
        self._pool_graphs = weakref.WeakKeyDictionary()  # KVPool -> PoolGraphs
        if mode == "frozen":
            self._stack = self._compiled_stack(required=compile_layers == "frozen")

    @property
    def _frozen_rows(self) -> int:
        """The most rows of a step that the frozen stack runs (``cpu_platform.frozen_max_rows``)."""
        return cpu_platform.frozen_max_rows(self.device, self.dtype)

    def _kv_splits(self, max_num_new: int, num_requests: int, longest: int) -> int:
        """Programs sharing each tile's keys in this step's kernel launches (1 off CUDA)."""
        if self._num_sms is None:
            return 1
        kernels = self._kernels
        programs = kernels.num_programs(self.num_heads, self.num_kv_heads, max_num_new, self.head_dim, num_requests)
        return kernels.kv_splits(programs, longest, self._num_sms)

    @property
    def compiled(self) -> bool:
        """Whether the layers run torch.compiled (``compile_layers``, after the start-up check)."""
        return self._dense != (_pre_attention, _post_attention) or self._stack is not None

    @torch.inference_mode()
    def _compiled_dense(self, required: bool):
        """``torch.compile``d ``_pre_attention`` and ``_post_attention``, compiled now on a probe through the first
        layer (one row, its own specialisation, and three rows, the dynamic graph every other row count reuses), and
        held to the eager functions there. A failure or a mismatch raises where compiling was asked for (``on``)
        and otherwise leaves the layers eager, with a warning (``auto``)."""
        t0 = time.perf_counter()
        compiled = tuple(torch.compile(f, dynamic=True, fullgraph=True) for f in (_pre_attention, _post_attention))
        ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down = self.layers[0]
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        generator = torch.Generator(self.device).manual_seed(0)
        try:
            for rows in (1, 3):
                x = torch.randn(rows, qkv_w.shape[0], generator=generator, device=self.device).to(self.dtype)
                attn = torch.randn(rows, self.q_size, generator=generator, device=self.device).to(self.dtype)
                pre_args = (x, ln1, qkv_w, qkv_b, self.cos[:rows], self.sin[:rows], self.eps, *shape)
                post_args = (x, attn, o_w, o_b, ln2, gate_up, down, self.eps)
                for fn, eager, args in zip(compiled, (_pre_attention, _post_attention), (pre_args, post_args), strict=True):
                    got, want = fn(*args), eager(*args)
                    for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)), strict=True):
                        error = relative_error(a, b) if a.shape == b.shape else float("inf")
                        if not error <= COMPILE_TOLERANCE[self.dtype]:
                            raise ValueError(f"{eager.__name__} compiled differs from eager at {rows} rows: "
                                             f"{tuple(a.shape)} vs {tuple(b.shape)}, relative error {error:.2g}")
        except Exception as exc:  # inductor's failures have many types; the eager layers stay right
            if required:
                raise
            log.warning("torch.compile of the layers failed, they run eager: %s", exc)
            return _pre_attention, _post_attention
        log.info("layers compiled (torch.compile, dynamic rows) in %.1f s", time.perf_counter() - t0)
        return compiled

    @torch.inference_mode()
    def _compiled_stack(self, required: bool):
        """The frozen stack (``_FrozenStack``) ``torch.compile``d under ``FROZEN_OPTIONS``, compiled now on a probe
        session (an 8-token prefill, then one row, its own specialisation, and three rows, the dynamic graph every
        other row count reuses; minutes for a real model, most of it autotuning) and held to the eager layers there.
        A failure or a mismatch raises where it was asked for (``frozen``) and otherwise leaves the layers eager,
        with a warning (``auto`` through $SPECMESH_COMPILE)."""
        t0 = time.perf_counter()
        stack = self._checked_stack(torch.compile(_FrozenStack(self), dynamic=True), required)
        if stack is not None:
            log.info("layer stack compiled frozen (torch.compile, max-autotune C++ GEMMs, dynamic rows) in %.1f s",
                     time.perf_counter() - t0)
        return stack

    @torch.inference_mode()
    def _checked_stack(self, stack, required: bool):
        """``stack`` once the probe has run it (compiling it on its first calls) within COMPILE_TOLERANCE of the
        eager layers; else the failure raised (``required``) or None with a warning."""
        import torch._inductor.config as inductor_config  # loaded with torch.compile's backend, not with torch

        ids = torch.randint(0, self.info.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        caches = (self.new_cache(), self.new_cache())
        try:  # inductor's global config, patched while the probe compiles (``torch.compile(options=)`` did not
            # freeze: measured 0.96x of eager instead of 0.6-0.8x at 2-8 rows)
            with inductor_config.patch(FROZEN_OPTIONS):
                self._probe_stack(stack, caches, ids)
        except Exception as exc:  # inductor's failures have many types; the eager layers stay right
            if required:
                raise
            log.warning("torch.compile of the frozen stack failed, the layers run eager: %s", exc)
            return None
        return stack

    def _probe_stack(self, stack, caches: tuple[PagedKVCache, PagedKVCache], ids: list[int]) -> None:
        """Run ``ids`` through the eager layers (caches[0]) and ``stack`` (caches[1]) as an 8-row prefill, one row
        and three rows, comparing the logits: ValueError beyond COMPILE_TOLERANCE. The runner's own stack is left
        as it was."""
        running = self._stack
        try:
            for start, end in ((0, 8), (8, 9), (9, 12)):
                args = (ids[start:end], list(range(start, end)), [end - start], [None])
                self._stack = None
                want = self.forward_batch([caches[0]], *args)
                self._stack = stack
                got = self.forward_batch([caches[1]], *args)
                error = relative_error(got, want)
                if not error <= COMPILE_TOLERANCE[self.dtype]:
                    raise ValueError(f"the frozen stack differs from eager at {end - start} rows: relative error "
                                     f"{error:.2g}")
        finally:
            self._stack = running

    def _load_kernels(self):
        """kernels.tree_attention, imported only for the triton backend (a CPU install needs no triton)."""
        try:
            from kernels import tree_attention
        except ImportError as exc:
            raise ValueError(f"the triton attention backend needs triton: {exc}") from exc
        if self.dtype not in tree_attention.SUPPORTED_DTYPES or self.head_dim > tree_attention.MAX_HEAD_DIM:
            raise ValueError(f"the tree-attention kernel takes {tree_attention.SUPPORTED_DTYPES} and head_dim <= "
                             f"{tree_attention.MAX_HEAD_DIM}, not {self.dtype} / {self.head_dim}")
        if self.device.type != "cuda" and not tree_attention.INTERPRETED:
            raise ValueError("the tree-attention kernel runs on CUDA, or on the CPU under the Triton interpreter "
                             "(TRITON_INTERPRET=1 before kernels.tree_attention is imported)")
        return tree_attention

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] -> [n, hidden] input embeddings."""
        if self.embed is not None:
            return self.embed[ids]
        # tied: the output layer's columns. Gather along its contiguous dimension: in a contiguous [hidden, vocab]
        # (float32) a gather along its rows, ~1 ms per 2000 tokens on the stdlib target, where reading the
        # transposed view row by row takes 7; in a transposed view of [vocab, hidden] (bf16/fp16 on a CPU) the
        # rows of that matrix (index_select along the view's dim 1 copies the whole matrix first: 57 ms a call
        # for SmolLM2's 49,152 x 576 in bf16)
        if self.lm_head.stride(0) == 1:
            return self.lm_head.t().index_select(0, ids)
        return self.lm_head.index_select(1, ids).t().contiguous()

    def _to_device(self, values: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[n] long on the runner's device: host data crosses without waiting for the device; a tensor already
        there (drafted tokens) is used as it is."""
        if isinstance(values, torch.Tensor) and values.device.type == torch.device(self.device).type:
            return values.long().reshape(-1)
        return torch.as_tensor(values, dtype=torch.long).to(self.device, non_blocking=True).reshape(-1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms(x, weight, self.eps)

    def forward(
        self,
        cache: PagedKVCache,
        input_ids: Sequence[int] | torch.Tensor,  # [num_new]
        position_ids: Sequence[int] | torch.Tensor,  # [num_new]
        attend: torch.Tensor | TreeMask | None = None,  # [num_new, cache.length + num_new] bool, or None = causal
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append ``input_ids`` to ``cache``; return their logits, [num_new, vocab] float32
        (``last_only``: the last token's, [1, vocab]; a prefill skips the output layer for the rest)."""
        num_new = len(input_ids)
        rows = slice(num_new - 1, num_new) if last_only else None
        return self.forward_batch([cache], input_ids, position_ids, [num_new], [attend], rows)

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: Sequence[PagedKVCache],
        input_ids: Sequence[int] | torch.Tensor,  # [T]: the new tokens of every request, packed
        position_ids: Sequence[int] | torch.Tensor,  # [T]
        num_new: Sequence[int],  # [B]: request r owns rows cu[r]:cu[r + 1], cu = cumsum([0] + num_new)
        attends: Sequence[torch.Tensor | TreeMask | None],  # [B]: [num_new[r], caches[r].length + num_new[r]]
        logit_rows: torch.Tensor | slice | None = None,  # packed rows whose logits are wanted (None = all)
        hidden_rows: torch.Tensor | None = None,  # packed rows whose final-layer features are wanted (None = none)
        *,
        eager: bool = False,  # never replay a CUDA graph (the graphs' own start-up check)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward over the new tokens of B sessions: the projections and the MLP run on all T rows at
        once, attention per session on its own keys (its prefix in its cache + its new rows, under its mask:
        None = causal). Appends each session's rows to its cache; returns the logits of ``logit_rows``,
        [R, vocab] float32. With ``hidden_rows``: (logits, features [len(hidden_rows), hidden] in the model's
        dtype), the features being the final norm's output (what the LM head reads; Falcon heads draft on them)."""
        ids, pos = self._to_device(input_ids), self._to_device(position_ids)
        total = ids.shape[0]
        assert sum(num_new) == total and len(caches) == len(num_new) == len(attends), (total, num_new)
        for cache, n in zip(caches, num_new, strict=True):
            cache.ensure(cache.length + n)
        meta = None  # the kernel path's metadata, built once for a graph replay or the eager launches
        if self._kernels is not None and KernelAttention.applies(caches, attends):
            meta = kernel_metadata(self, caches, num_new, attends)
        graphs = None
        if meta is not None and hidden_rows is None and not eager:
            graphs = self.pool_graphs(caches[0].pool)
        if graphs is not None and (logits := graphs.forward(meta, ids, pos, num_new)) is not None:
            for cache, n in zip(caches, num_new, strict=True):
                cache.length += n
            return logits if logit_rows is None else logits[logit_rows]
        if meta is not None:
            attention = KernelAttention(self, meta, num_new)
        else:
            attention = SdpaAttention(self, caches, num_new, attends)
        logits, features = self._layers(ids, pos, attention, logit_rows, hidden_rows)
        for cache, n in zip(caches, num_new, strict=True):
            cache.length += n
        return logits if features is None else (logits, features)

    def forward_eager(self, cache, input_ids: Sequence[int], position_ids: Sequence[int]) -> torch.Tensor:
        """``forward`` without CUDA graphs: [num_new, vocab] float32."""
        return self.forward_batch([cache], input_ids, position_ids, [len(input_ids)], [None], eager=True)

    @property
    def cuda_graphs(self) -> str:
        """``on``, ``auto`` or ``off``: the CUDA-graph mode in force (``auto`` turns ``off`` if a check fails)."""
        return self._graph_mode or "off"

    @property
    def graph_replays(self) -> int:
        """Steps served by CUDA graphs (or their static-buffer path off CUDA) so far, over every pool."""
        return sum(graphs.replays for graphs in self._pool_graphs.values())

    def graph_stats(self) -> dict[str, float]:
        """Over every pool so far: ``replays`` (steps served by a graph), ``eager`` (steps that fit no bucket),
        ``captures`` (buckets captured, the start-up ones included) and ``capture_seconds`` (their time)."""
        pools = list(self._pool_graphs.values())
        return {name: sum(getattr(graphs, name) for graphs in pools)
                for name in ("replays", "eager", "captures", "capture_seconds")}

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, attention, logit_rows=None, hidden_rows=None):
        """The stack over packed rows ids/pos [T] with ``attention`` (its caches already hold the step's blocks):
        (logits of ``logit_rows`` [R, vocab] float32, final-norm features of ``hidden_rows`` or None). Pure device
        work: what a CUDA graph captures (cuda_graphs.py)."""
        cos, sin = self.cos[pos], self.sin[pos]
        x = self._embed(ids)  # [T, hidden]
        if self._stack is not None and x.shape[0] <= self._frozen_rows:
            _FROZEN.attention = attention
            try:
                x = self._stack(x, cos, sin)
            finally:
                _FROZEN.attention = None
        else:
            pre, post = self._dense
            for i, (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down) in enumerate(self.layers):
                q, k, v = pre(x, ln1, qkv_w, qkv_b, cos, sin, self.eps, self.num_heads, self.num_kv_heads,
                              self.head_dim)
                x = post(x, attention(i, q, k, v), o_w, o_b, ln2, gate_up, down, self.eps)
        features = None if hidden_rows is None else self._rms(x[hidden_rows], self.norm)
        if logit_rows is not None:
            x = x[logit_rows]
        return self._logits(self._rms(x, self.norm)), features

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-norm features x [n, hidden] -> logits [n, vocab] float32: the blocked copy of the output layer
        for 2+ rows where there is one, else ``lm_head`` (at one row its contiguous [hidden, vocab] is fastest)."""
        if self.head_blocks is None or x.shape[0] < 2:
            return cpu_platform.linear(x, self.lm_head, self.lm_head_bias).float()
        logits = cpu_platform.blocked_product(x, self.head_blocks, self.lm_head.shape[1])
        return (logits if self.lm_head_bias is None else logits + self.lm_head_bias).float()

    def pool_graphs(self, pool: KVPool) -> PoolGraphs | None:
        """The pool's CUDA graphs, created (checked against eager on a probe session, the decode buckets captured) on
        first call: a verifier calls it when it builds its pool, so both happen at start-up. None with graphs off,
        when the check failed under ``auto`` (every step then runs eager), and for a pool that grows (``new_cache``'s:
        a graph would keep reading the tensors it had before growing)."""
        if not self._graph_mode or self._kernels is None or not pool.fixed:
            return None
        graphs = self._pool_graphs.get(pool)
        if graphs is None:
            graphs = PoolGraphs(self, pool, capture=self.device.type == "cuda", required=self._graph_mode == "on")
            if not graphs.check():
                self._graph_mode = None  # the check failed under auto: eager from now on (it said why)
                return None
            graphs.warm()  # every plain-decoding bucket now: no decode step pays a capture mid-serving
            self._pool_graphs[pool] = graphs
        return graphs


def make_runner(model: PreTrainedModel, backend: str = "auto", attention: str = "auto",
                compile_layers: str = "auto", cuda_graphs: str = "auto") -> ModelRunner:
    """``auto``: the fast runner where it applies, else Hugging Face; ``hf`` / ``fast`` force one.
    ``attention``: the fast runner's attention backend (ATTENTION_BACKENDS); ``compile_layers``: whether it
    torch.compiles its layers (COMPILE_MODES, ``compile_choice``); ``cuda_graphs``: whether it replays its kernel
    steps as CUDA graphs (GRAPH_MODES, ``cuda_graphs.graph_choice``)."""
    if backend == "hf":
        return ModelRunner(model)
    if backend == "fast" or (backend == "auto" and supports(model) is None):
        return FastLlamaRunner(model, attention, compile_layers, cuda_graphs)
    if backend != "auto":
        raise ValueError(f"unknown runner backend {backend!r}; choose auto, hf or fast")
    return ModelRunner(model)



__all__ = ["FastLlamaRunner", "attention_backend", "compile_choice", "make_runner", "supports"]
