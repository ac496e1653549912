"""The one function that turns logits into the distribution we sample from.

Draft and target use the same warping (temperature, then top-k, then top-p), so "p" and
"q" in the verification code always mean *warped* distributions.
"""

from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Softmax of warped logits, in ``dtype`` (float64 by default: the drafters' q and the reference; the
    verifier's device acceptance warps in float32).

    logits: [..., vocab]. Returns probs [..., vocab] summing to 1. temperature must be > 0
    (greedy decoding uses argmax, not this function).
    """
    assert temperature > 0.0, "warp_probs is for sampling; use argmax for greedy"
    x = logits.to(dtype) / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cum_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = cum_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs

