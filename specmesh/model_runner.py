"""Run a Hugging Face causal LM over token trees on top of a per-session KV cache.

One ``ModelRunner`` per model (weights shared by all sessions). A session's keys/values live in the paged pool
of the verifier (or of the draft model: ``drafter_service/draft_kv.py``), the same ``KVPool`` / ``PagedKVCache``
the fast runner uses: ``new_pool`` makes one for any model whose attention layers all cache keys and values of
one shape (probed once with a one-token forward: Llama, Qwen, Mistral without a sliding window, GPT-2, ...), and
``forward`` hands transformers a ``Cache`` whose layers write the new rows into the session's slots and read its
positions back (``_paged_cache``: a view where the session's blocks are one run, else a gather); ``new_cache``
is a session outside any pool (a ``GrowingKVPool`` of its own). Models with other caches (sliding windows, linear
attention, layers of different shapes) are refused when the runner is built (``paged_shape``: ValueError; why,
in ``specmesh/kv_pool.py``). ``forward`` appends the new tokens' keys/values to the cache and returns their
logits; the cache's ``keep`` compacts it to the accepted path after a tree step. The tree structure reaches the model as an explicit 4-D additive
attention mask plus explicit position ids, which every transformers 5 decoder honours (a 4-D mask is used as
given).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specmesh.blocks import DEFAULT_BLOCK_SIZE
from specmesh.contract import ModelInfo
from specmesh.kv_pool import GrowingKVPool, KVPool, PagedKVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@functools.cache
def _paged_cache_class():
    """transformers' ``Cache`` over one session of a ``KVPool`` for one forward (made on first use: transformers
    is imported by the runners that need it)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class PagedLayer(CacheLayerMixin):
        """One layer: ``update`` writes the forward's new keys/values [1, kv_heads, n, head_dim] at the session's
        positions [start, start + n) and returns its keys/values of positions [0, start + n)."""

        is_sliding = False

        def __init__(self, session: PagedKVCache, layer: int, start: int) -> None:
            super().__init__()
            self.session, self.layer, self.start = session, layer, start

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device, self.is_initialized = key_states.device, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.start + key_states.shape[-2]
            self.session.write(self.layer, self.start, key_states[0], value_states[0])
            keys, values = self.session.kv(self.layer, end)
            return keys[None], values[None]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.start + query_length, 0

        def get_seq_length(self) -> int:
            return self.start  # the positions before this forward's (masks and cache positions are built from it)

        def get_max_length(self) -> int:
            return -1

    class PagedCache(Cache):
        def __init__(self, session: PagedKVCache, num_layers: int) -> None:
            super().__init__(layers=[PagedLayer(session, layer, session.length) for layer in range(num_layers)])

    return PagedCache


def _paged_cache(session: PagedKVCache, num_layers: int):
    return _paged_cache_class()(session, num_layers)


def paged_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a paged pool for ``model``: probed with a one-token forward into a
    transformers ``DynamicCache``, whose every layer must be a full-attention ``DynamicLayer`` holding keys and values
    of one shape in the model's dtype. ValueError naming what it found otherwise (``kv_pool``'s doc says why such
    models are refused)."""
    from transformers import DynamicCache  # imported by the runner that needs it (a fast runner does not)
    from transformers.cache_utils import DynamicLayer

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
              position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    layers = cache.layers
    kinds = {type(layer) for layer in layers}
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype) for layer in layers
              if type(layer) is DynamicLayer and layer.keys is not None}
    name = type(model).__name__
    if not layers or kinds != {DynamicLayer} or len(shapes) != 1:
        found = ", ".join(sorted(kind.__name__ for kind in kinds)) or "none"
        raise ValueError(f"{name} is not supported: its attention caches ({found}) are not full-attention keys and "
                         "values of one shape in every layer, which specmesh's paged KV pool needs (sliding windows "
                         "and linear attention are not supported)")
    (keys, values, cache_dtype), = shapes
    if len(keys) != 4 or keys[0] != 1 or keys[2] != 1 or keys != values or cache_dtype != dtype:
        raise ValueError(f"{name} is not supported: its attention caches hold keys {keys} and values {values} in "
                         f"{cache_dtype}, not one [1, kv_heads, 1, head_dim] shape in the model's {dtype}, which "
                         "specmesh's paged KV pool needs")
    return len(layers), keys[1], keys[3]


class ModelRunner:
    """Stateless forward passes of one model over any session's cache. ValueError for a model whose attention
    caches do not fit a paged pool (``paged_shape``)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._adopt(model)
        self.paged_shape = paged_shape(model)  # (layers, kv_heads, head_dim) of its pools

    def _adopt(self, model: PreTrainedModel) -> None:
        """The model, its ``info``, dtype and device (what every runner built on a transformers module reads)."""
        self.model = model.eval()
        cfg = model.config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else ()
        eos = (eos,) if isinstance(eos, int) else tuple(eos)
        vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else cfg.vocab_size
        self.info = ModelInfo(
            vocab_size=int(vocab),
            max_positions=int(getattr(cfg, "max_position_embeddings", 1 << 30) or 1 << 30),
            eos_token_ids=eos,
        )
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def new_cache(self) -> PagedKVCache:
        """An empty session cache outside any budget: a pool of its own that grows with it (``GrowingKVPool``)."""
        return GrowingKVPool(*self.paged_shape, self.info.max_positions, DEFAULT_BLOCK_SIZE, self.dtype,
                             self.device).open(0)

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVPool:
        """A paged KV pool of ``num_blocks`` blocks for this model's sessions (``PagedKVCache``s from ``pool.open``)."""
        return KVPool(*self.paged_shape, num_blocks, block_size, self.dtype, self.device)

    def pool_graphs(self, pool: KVPool) -> None:
        """No CUDA graphs: the transformers forward runs eager (``FastLlamaRunner.pool_graphs`` has them)."""
        return None

    @property
    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(*self.paged_shape, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        cache: PagedKVCache,
        input_ids: Sequence[int] | torch.Tensor,  # [num_new]
        position_ids: Sequence[int] | torch.Tensor,  # [num_new]
        attend: torch.Tensor | TreeMask | None = None,  # [num_new, cache.length + num_new] bool, or None = causal
        last_only: bool = False,
        features: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` to ``cache`` and return their logits, [num_new, vocab] float32
        (``last_only``: the last token's, [1, vocab]; a prefill skips the output layer for the rest).
        ``features``: (logits, the final-layer features of every new token [num_new, hidden]: the base model's
        last hidden state, after its final norm, which the LM head reads)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        pos = torch.as_tensor(position_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        num_new = ids.shape[1]
        cache.ensure(cache.length + num_new)  # CapacityError (nothing written) when the pool is short
        past = _paged_cache(cache, self.paged_shape[0])
        mask = None
        if isinstance(attend, TreeMask):
            attend = attend.dense(self.device)
        if attend is not None:
            assert attend.shape == (num_new, cache.length + num_new), (attend.shape, cache.length, num_new)
            mask = torch.zeros(attend.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~attend.to(self.device), torch.finfo(self.dtype).min)
            mask = mask[None, None]  # [1, 1, num_new, total]
        if features:  # the base model, then its LM head: the features are its last hidden state
            hidden = self.model.base_model(input_ids=ids, position_ids=pos, attention_mask=mask,
                                           past_key_values=past, use_cache=True).last_hidden_state[0]
            cache.length += num_new
            head = self.model.get_output_embeddings()
            return head(hidden[-1:] if last_only else hidden).float(), hidden
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        cache.length += num_new
        return out.logits[0].float()

    def forward_batch(
        self,
        caches: Sequence[PagedKVCache],
        input_ids: Sequence[int] | torch.Tensor,  # [T]: the new tokens of every request, packed
        position_ids: Sequence[int] | torch.Tensor,  # [T]
        num_new: Sequence[int],  # [B]
        attends: Sequence[torch.Tensor | TreeMask | None],  # [B]: [num_new[r], caches[r].length + num_new[r]]
        logit_rows: torch.Tensor | slice | None = None,  # packed rows whose logits are wanted (None = all)
        hidden_rows: torch.Tensor | None = None,  # packed rows whose final-layer features are wanted
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The batched entry point of ``FastLlamaRunner.forward_batch``; the generic Hugging Face path runs
        one forward per request (same results, no shared forward)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        pos = torch.as_tensor(position_ids, dtype=torch.long).reshape(-1)
        outs, hiddens, row = [], [], 0
        for cache, n, attend in zip(caches, num_new, attends, strict=True):
            out = self.forward(cache, ids[row : row + n], pos[row : row + n], attend, features=hidden_rows is not None)
            if hidden_rows is not None:
                out, hidden = out
                hiddens.append(hidden)
            outs.append(out)
            row += n
        logits = torch.cat(outs) if outs else torch.zeros(0, self.info.vocab_size)
        logits = logits if logit_rows is None else logits[logit_rows]
        if hidden_rows is None:
            return logits
        return logits, torch.cat(hiddens)[hidden_rows.to(logits.device)]


def tree_attend_mask(prefix_len: int, ancestor_rows: torch.Tensor) -> torch.Tensor:
    """Mask for new tokens arranged as a tree on top of ``prefix_len`` cached positions.

    ancestor_rows: [num_new, num_tree] bool, over the last num_tree positions of the attended span
    (num_tree >= num_new: tree positions already in the cache come first). Returns
    [num_new, prefix_len + num_tree] bool on ancestor_rows' device: every new token sees the whole prefix
    (only the tree part crosses from the host).
    """
    num_new = ancestor_rows.shape[0]
    prefix = torch.ones(num_new, prefix_len, dtype=torch.bool, device=ancestor_rows.device)
    return torch.cat([prefix, ancestor_rows], dim=1)


@dataclass(frozen=True)
class TreeMask:
    """The attention mask of new tokens arranged as a tree, kept in its structured form: every new token sees
    the whole prefix [0, prefix_len) and, of the tree positions after it, its ancestors and itself.

    The fast runner's kernel path reads it as is (the ancestors become a bitmask: no [num_new, prefix_len]
    mask is ever built); ``dense`` is the explicit mask of ``tree_attend_mask`` for the other paths.
    Nodes are in topological order (a node's ancestors come before it), as ``TokenTree`` guarantees.
    """

    prefix_len: int
    ancestors: torch.Tensor  # [num_new, num_tree] bool, num_tree >= num_new (tree positions in the cache first)

    @property
    def shape(self) -> tuple[int, int]:
        """The dense mask's shape: [num_new, prefix_len + num_tree]."""
        num_new, num_tree = self.ancestors.shape
        return num_new, self.prefix_len + num_tree

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[num_new, prefix_len + num_tree] bool on ``device`` (default: the ancestors')."""
        return tree_attend_mask(self.prefix_len, self.ancestors.to(device) if device is not None else self.ancestors)
