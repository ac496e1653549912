"""Sampling parameters and the one function that turns logits into the distribution p we sample from.

Draft and target use the same warping (temperature, then top-k, then top-p), so
"p" and "q" in the verification code always mean *warped* distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of warped logits, in float64.

    logits: [..., vocab]. Returns probs [..., vocab] summing to 1. temperature must be > 0
    (greedy decoding uses argmax, not this function).
    """
    assert temperature > 0.0, "warp_probs is for sampling; use argmax for greedy"
    x = logits.double() / temperature
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


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution (probs: [vocab])."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
