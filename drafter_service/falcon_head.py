"""The Falcon draft head: a semi-autoregressive (SAR) drafter on the target's own features.

Notation (0-based positions): x[j] is the token at position j, f[j] the target's final-layer feature at j
(the vector its LM head reads: the output of the final RMSNorm, so ``logits = lm_head(f[j])`` predicts
x[j + 1]). The head's input at position j is ``[f[j - 1]; embed(x[j])]`` (f[-1] = 0), with the target's
embedding table and LM head shared and frozen (never saved with the head).

    input [2H] -> 2-layer LSTM (2H -> H, recurrent over positions) -> RMSNorm -> self-attention
    (one Llama-style layer: RoPE, GQA) + residual -> RMSNorm -> SiLU MLP + residual = out [H]

Row j's output predicts the feature f[j - 1 + k], so ``lm_head(out[j])`` is the head's distribution of
x[j + k] (no norm in between: the output stands where a final-norm feature stands). A head may draft from a
reduced vocabulary (``draft_vocab`` = N, as EAGLE-3): its LM head is the N rows of the target's for the N most
frequent tokens of its training corpus (``vocab_ids``, draft index -> target id, saved with the head), so its
distributions cost N / vocab of the full LM head and give every other token q = 0 (exact: the verifier's
rejection sampling only needs q of what is drafted, and q = 0 elsewhere). With the relaxed causal
mask, the k rows of a block see the whole block and everything before it, so one forward over the last k
positions of a context (rows n-k..n-1, seeing everything up to n-1) drafts the next k tokens x[n..n+k-1], and
its k outputs are the stand-in features of those positions' inputs when a later forward extends them.

A head is saved as a folder: ``config.json`` (its sizes, k, the target's fingerprint) and
``model.safetensors`` (only the head's own weights). ``load_head`` refuses a head trained for another target
(hidden size, vocabulary, or a hash of the embedding / LM head weights differ).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specmesh.cpu_platform import in_out_layout

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEAD_KIND = "specmesh-falcon-head"
SUPPORTED_K = (1, 2, 3, 4)


# ----------------------------------------------------------------------------------------- the target's part
@dataclass(frozen=True)
class TargetTables:
    """What the head shares with its target, frozen: the input embedding and the LM head."""

    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    lm_bias: torch.Tensor | None = None  # [vocab]

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def fingerprint(self) -> str:
        """A hash of the embedding and LM head weights (float32, a strided sample of rows so it stays cheap)."""
        digest = hashlib.sha256()
        for table in (self.embed, self.lm_head):
            rows = table.detach().float().cpu()[:: max(1, table.shape[0] // 256)]
            digest.update(str(tuple(table.shape)).encode())
            # rounded, so that float32 and a bf16 load of the same checkpoint agree
            digest.update(torch.round(rows.to(torch.bfloat16).float() * 256).to(torch.int32).numpy().tobytes())
        return digest.hexdigest()[:32]

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> TargetTables:
        bias = None if self.lm_bias is None else self.lm_bias.to(device=device, dtype=dtype)
        return TargetTables(self.embed.to(device=device, dtype=dtype), self.lm_head.to(device=device, dtype=dtype),
                            bias)


def target_tables(runner_or_model) -> TargetTables:
    """The embedding and LM head of a ModelRunner / FastLlamaRunner or a HF causal LM."""
    fast_head = getattr(runner_or_model, "lm_head", None)
    if isinstance(fast_head, torch.Tensor):  # a FastLlamaRunner's own tables (one read from a checkpoint has no module)
        head, bias = fast_head.t(), runner_or_model.lm_head_bias  # [vocab, hidden] view
        embed = runner_or_model.embed if runner_or_model.embed is not None else head
        return TargetTables(embed.detach(), head.detach(), None if bias is None else bias.detach())
    is_lm = hasattr(runner_or_model, "get_output_embeddings")
    model = runner_or_model if is_lm else runner_or_model.model
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings().weight.detach()
    bias = getattr(head, "bias", None)
    return TargetTables(embed, head.weight.detach(), None if bias is None else bias.detach())


# ------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class FalconConfig:
    hidden_size: int
    vocab_size: int
    k: int = 2  # tokens per block (one forward drafts k tokens)
    num_heads: int = 8
    num_kv_heads: int = 8
    intermediate_size: int = 1024
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    lstm_layers: int = 2
    target_fingerprint: str = ""
    glancing: bool = True  # trained with CSGD (False: a plain SAR head); informational
    draft_vocab: int = 0  # tokens the head drafts from (its LM head's rows); 0 = the target's whole vocabulary
    kind: str = HEAD_KIND

    def __post_init__(self) -> None:
        if self.k not in SUPPORTED_K:
            raise ValueError(f"k must be one of {SUPPORTED_K}, got {self.k}")
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must be in [0, {self.vocab_size}] (0: the whole vocabulary), "
                             f"got {self.draft_vocab}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into num_heads, num_heads into num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def for_target(tables: TargetTables, k: int = 2, **sizes) -> FalconConfig:
        hidden = tables.hidden_size
        heads = sizes.pop("num_heads", max(1, hidden // 64))
        return FalconConfig(hidden, tables.vocab_size, k, heads, sizes.pop("num_kv_heads", heads),
                            target_fingerprint=tables.fingerprint(), **sizes)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_tables(head_dim: int, theta: float, positions: torch.Tensor, dtype: torch.dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv[None]  # [n, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., n, head_dim]; cos/sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def block_mask(length: int, k: int, device=None) -> torch.Tensor:
    """The relaxed causal mask of training sequences, [length, length] bool: blocks of k positions aligned at
    0; a row sees every position up to the end of its own block."""
    block_end = (torch.arange(length, device=device) // k + 1) * k  # exclusive
    return torch.arange(length, device=device)[None, :] < block_end[:, None]


# --------------------------------------------------------------------------------------------------- module
class FalconHead(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.config = config
        h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.lstm = nn.LSTM(2 * h, h, num_layers=config.lstm_layers, batch_first=True)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.tables: TargetTables | None = None  # attached with ``attach``; never part of the state dict
        if config.draft_vocab:  # draft index -> target id (set by ``set_vocab`` or loaded with the weights)
            self.register_buffer("vocab_ids", torch.arange(config.draft_vocab, dtype=torch.int64))
        else:
            self.vocab_ids = None
        self._draft_head: tuple | None = None  # (LM head rows drafted from [hidden, V], their bias), on first use
        self._host_ids: np.ndarray | None = None  # vocab_ids on the host, read on first use
        self.register_load_state_dict_post_hook(lambda module, _keys: module._forget_draft_head())

    # ------------------------------------------------------------------ the target
    def attach(self, tables: TargetTables, check: bool = True) -> FalconHead:
        """Share the target's embedding and LM head (cast to the head's dtype). ``check``: refuse a target that
        is not the one the head was made for."""
        if check:
            check_target(self.config, tables)
        p = next(self.parameters())
        self.tables = tables.to(p.dtype, p.device)
        self._forget_draft_head()
        return self

    def _forget_draft_head(self) -> None:
        """The draft vocabulary's LM-head rows (and host ids) are read again on next use (new tables, ids set or
        loaded)."""
        self._draft_head = None
        self._host_ids = None

    def set_vocab(self, ids: torch.Tensor | np.ndarray | list[int]) -> FalconHead:
        """The target ids of a reduced head's draft vocabulary, [draft_vocab], distinct (training picks them)."""
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        if self.vocab_ids is None or ids.shape != self.vocab_ids.shape:
            raise ValueError(f"this head drafts from {self.config.draft_vocab or 'the whole'} vocabulary; "
                             f"got {ids.numel()} ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size or len(set(ids.tolist())) != ids.numel():
            raise ValueError(f"draft vocabulary ids must be distinct and in [0, {self.config.vocab_size})")
        self.vocab_ids.copy_(ids.to(self.vocab_ids.device))
        self._forget_draft_head()
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.tables.embed)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., hidden] head outputs -> [..., V] logits over the head's draft vocabulary (float32): V = the
        target's vocabulary, or ``draft_vocab`` (index i is target id ``vocab_ids[i]``: ``to_target``)."""
        tables = self.tables
        if self.vocab_ids is None:
            return F.linear(out, tables.lm_head, tables.lm_bias).float()
        if self._draft_head is None:  # the rows in the layout a product of a few rows runs fastest in
            ids = self.vocab_ids.to(tables.lm_head.device)
            self._draft_head = (in_out_layout(tables.lm_head[ids]), None if tables.lm_bias is None else tables.lm_bias[ids])
        head_t, bias = self._draft_head  # [hidden, V]
        logits = out @ head_t
        return (logits if bias is None else logits + bias).float()

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] target features -> [..., vocab] the target's own logits (float32; training reads them)."""
        return F.linear(features, self.tables.lm_head, self.tables.lm_bias).float()

    def draft_ids(self) -> np.ndarray | None:
        """A reduced head's ``vocab_ids`` on the host (index -> target id; drafting maps its picks with it), read
        once per vocabulary like the LM-head rows; None for a full-vocabulary head."""
        if self.vocab_ids is None:
            return None
        if self._host_ids is None:
            self._host_ids = self.vocab_ids.cpu().numpy()
        return self._host_ids

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids (the identity for a full-vocabulary head)."""
        return index if self.vocab_ids is None else self.vocab_ids.to(index.device)[index]

    def to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft-vocabulary indices, -1 for a token outside a reduced head's vocabulary."""
        if self.vocab_ids is None:
            return ids
        table = torch.full((self.config.vocab_size,), -1, dtype=torch.int64, device=ids.device)
        table[self.vocab_ids.to(ids.device)] = torch.arange(self.config.draft_vocab, device=ids.device)
        return table[ids]

    # --------------------------------------------------------------- pieces (shared by training and drafting)
    def inputs(self, prev_features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[..., hidden] features f[j-1] and [...] tokens x[j] -> [..., 2 * hidden] head inputs."""
        return torch.cat([prev_features.to(self.tables.embed.dtype), self.embed(ids)], dim=-1)

    def project_kv(self, s: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LSTM outputs s [n, hidden] at ``positions`` [n] -> keys, values [kv_heads, n, head_dim] (RoPE'd keys)."""
        cfg = self.config
        h = _rms(s, self.input_norm, cfg.rms_eps)
        keys = self.k_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        values = self.v_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        cos, sin = _rope_tables(cfg.head_dim, cfg.rope_theta, positions, keys.dtype)
        return _rope(keys, cos, sin), values

    def decode_rows(self, s: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder layer for query rows with LSTM outputs s [n, hidden] at ``positions`` [n] over keys/values
        [kv_heads, L, head_dim] (which already hold the rows' own), under mask [n, L] bool (None: all).
        Returns the outputs [n, hidden]."""
        cfg = self.config
        h = _rms(s, self.input_norm, cfg.rms_eps)
        q = self.q_proj(h).view(-1, cfg.num_heads, cfg.head_dim).transpose(0, 1)  # [heads, n, head_dim]
        cos, sin = _rope_tables(cfg.head_dim, cfg.rope_theta, positions, q.dtype)
        q = _rope(q, cos, sin)
        groups = cfg.num_heads // cfg.num_kv_heads
        attn = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                              enable_gqa=groups > 1)[0]
        x = s + self.o_proj(attn.transpose(0, 1).reshape(-1, cfg.hidden_size))
        h = _rms(x, self.post_norm, cfg.rms_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def lstm_steps(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor):
        """The LSTM run step by step, every position's state kept (rollbacks cut anywhere). Drafting uses it for
        every LSTM call: at drafting sizes (a few rows) it is ~2x faster on CPU than ``nn.LSTM``, whose CPU
        kernel re-packs the weights each call; training keeps ``nn.LSTM`` (autograd, long sequences).

        x: [B, n, 2H]; h0/c0: [layers, B, H]. Returns outputs [B, n, H] and the states after every step,
        hs/cs [n, layers, B, H]. Same math as ``nn.LSTM`` (gates i, f, g, o)."""
        layers = self.config.lstm_layers
        inp = x
        hs_all, cs_all = [], []
        for layer in range(layers):
            w_ih = getattr(self.lstm, f"weight_ih_l{layer}")
            w_hh = getattr(self.lstm, f"weight_hh_l{layer}")
            b = getattr(self.lstm, f"bias_ih_l{layer}") + getattr(self.lstm, f"bias_hh_l{layer}")
            pre = F.linear(inp, w_ih, b)  # [B, n, 4H], the input part of every step at once
            h, c = h0[layer], c0[layer]
            outs, cs = [], []
            for t in range(x.shape[1]):
                gates = pre[:, t] + F.linear(h, w_hh)
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
                cs.append(c)
            inp = torch.stack(outs, dim=1)  # [B, n, H]
            hs_all.append(torch.stack(outs))  # [n, B, H]
            cs_all.append(torch.stack(cs))
        return inp, torch.stack(hs_all, dim=1), torch.stack(cs_all, dim=1)

    def zero_state(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        p = next(self.parameters())
        shape = (self.config.lstm_layers, batch, self.config.hidden_size)
        return torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)

    # ------------------------------------------------------------------------------------ training forward
    def forward(self, prev_features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Training: prev_features [B, T, H] (row j holds f[j-1]), ids [B, T] -> outputs [B, T, H] under the
        block mask (row j predicts f[j-1+k] and, through the LM head, x[j+k])."""
        cfg = self.config
        x = self.inputs(prev_features, ids)
        s, _ = self.lstm(x)  # [B, T, H]
        batch, length, _ = s.shape
        h = _rms(s, self.input_norm, cfg.rms_eps)
        positions = torch.arange(length, device=s.device)
        cos, sin = _rope_tables(cfg.head_dim, cfg.rope_theta, positions, s.dtype)
        q = _rope(self.q_proj(h).view(batch, length, cfg.num_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        keys = _rope(self.k_proj(h).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        values = self.v_proj(h).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=block_mask(length, cfg.k, s.device),
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        out = s + self.o_proj(attn.transpose(1, 2).reshape(batch, length, cfg.hidden_size))
        h = _rms(out, self.post_norm, cfg.rms_eps)
        return out + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------------- save / load
def check_target(config: FalconConfig, tables: TargetTables) -> None:
    """ValueError unless ``tables`` are the target the head was made for."""
    if tables.hidden_size != config.hidden_size or tables.vocab_size != config.vocab_size:
        raise ValueError(f"this Falcon head was made for a target with hidden size {config.hidden_size} and "
                         f"vocabulary {config.vocab_size}; the target has {tables.hidden_size} and {tables.vocab_size}")
    if config.target_fingerprint and tables.fingerprint() != config.target_fingerprint:
        raise ValueError("this Falcon head was trained for another target: the target's embedding / LM head "
                         f"fingerprint is {tables.fingerprint()}, the head expects {config.target_fingerprint}")


def save_head(head: FalconHead, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16,
              extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (the head's own weights only, in ``dtype``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()).contiguous().cpu()
             for name, t in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    meta = asdict(head.config) | {"num_parameters": head.num_parameters()} | (extra or {})
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def is_head_dir(path: str | Path) -> bool:
    config = Path(path) / CONFIG_FILE
    try:
        return json.loads(config.read_text()).get("kind") == HEAD_KIND
    except (OSError, ValueError):
        return False


def load_head(path: str | Path, tables: TargetTables | None = None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> FalconHead:
    """A saved head (attached to ``tables`` when given; ValueError if they are another target's)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_head_dir(path):
        raise ValueError(f"{path} is not a Falcon head directory (no {CONFIG_FILE} of kind {HEAD_KIND!r})")
    meta = json.loads((path / CONFIG_FILE).read_text())
    fields = FalconConfig.__dataclass_fields__
    config = FalconConfig(**{k: v for k, v in meta.items() if k in fields})
    head = FalconHead(config)
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                          for k, v in load_file(str(path / WEIGHTS_FILE)).items()})
    head = head.to(device=device, dtype=dtype).eval()
    if tables is not None:
        head.attach(tables)
    return head


def head_tree(path: str | Path) -> dict:
    """The decoding-tree settings stored with a head (``config.json`` ``"tree"``, chosen by measuring; see
    ``drafter_service/falcon.py``), {} when it stores none."""
    return dict(json.loads((Path(path) / CONFIG_FILE).read_text()).get("tree", {}))


def random_head(tables: TargetTables, k: int = 2, seed: int = 0, **sizes) -> FalconHead:
    """An untrained head for ``tables`` (tests and the registry-wide checks: drafts are valid, rarely right); with
    ``draft_vocab`` = N, its draft vocabulary is N random ids of the target's."""
    torch.manual_seed(seed)
    sizes.setdefault("intermediate_size", 2 * tables.hidden_size)
    head = FalconHead(FalconConfig.for_target(tables, k, **sizes)).to(device=tables.embed.device, dtype=tables.embed.dtype)
    if head.config.draft_vocab:
        head.set_vocab(torch.randperm(tables.vocab_size)[: head.config.draft_vocab].sort().values)
    return head.eval().attach(tables)
