"""The one function that turns logits into the distribution we sample from.

Draft and target use the same warping (temperature, then top-k, then top-p), so "p" and
"q" in the verification code always mean *warped* distributions.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        if CPU_SHORTCUT and probs.device.type == "cpu":
            drop = _top_p_drop_cpu(probs, top_p)
        else:
            drop = _top_p_drop(probs, top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


WarpKey = tuple[float, int, float]  # (temperature, top_k, top_p)


def warp_groups(keys: Sequence[WarpKey | None], device: torch.device | str) -> list[tuple[WarpKey, torch.Tensor]]:
    """The rows of each distinct warping among ``keys`` (one per row; None: a row not warped), as index tensors on
    ``device``, for ``warp_grouped``: built once, they serve every call over rows laid out the same way."""
    groups: dict[WarpKey, list[int]] = {}
    for row, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(row)
    return [(key, torch.tensor(rows).to(device, non_blocking=True)) for key, rows in groups.items()]


def warp_grouped(logits: torch.Tensor, groups: Sequence[tuple[WarpKey, torch.Tensor]], dtype: torch.dtype,
                 fill: float = 1.0) -> torch.Tensor:
    """Each row of logits [R, vocab] warped with its own parameters (``warp_groups``): one ``warp_probs`` per group;
    rows of no group are ``fill``. A single group covering every row is warped as it is, without a copy."""
    if len(groups) == 1 and len(groups[0][1]) == logits.shape[0]:
        (temperature, top_k, top_p), _ = groups[0]
        return warp_probs(logits, temperature, top_k, top_p, dtype=dtype)
    probs = torch.full(logits.shape, fill, dtype=dtype, device=logits.device)
    for (temperature, top_k, top_p), index in groups:
        probs.index_copy_(0, index, warp_probs(logits.index_select(0, index), temperature, top_k, top_p, dtype=dtype))
    return probs


# On the CPU, top-p first looks among each row's TOP_P_CANDIDATES most likely tokens (a partial sort, ~7x
# cheaper than sorting 8,192 columns) and sorts whole only the rows whose candidates do not reach top_p (flat
# ones, told apart first by a bound on their candidates' mass): the same tokens kept, decided on the host, which
# on the CPU is where the tensor is. On an accelerator the full sort runs (no host read). Tests turn the shortcut
# off to hold the device path to one transfer per step.
CPU_SHORTCUT = True
TOP_P_CANDIDATES = 256


def _top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., vocab] bool: the tokens outside the smallest most-likely prefix whose mass reaches top_p (always at
    least one token kept)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    cum_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = cum_before >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _top_p_drop_cpu(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``_top_p_drop`` from the top TOP_P_CANDIDATES of each row whose mass reaches top_p there; a row whose
    candidates cannot (a bound from one pass says so, or their mass does) is sorted whole, as ``_top_p_drop``
    does."""
    if probs.shape[-1] <= TOP_P_CANDIDATES:
        return _top_p_drop(probs, top_p)
    rows = probs.reshape(-1, probs.shape[-1])
    drop = torch.empty(rows.shape, dtype=torch.bool)
    # a row whose candidates cannot reach top_p goes straight to the sort: K candidates hold at most the mass of
    # the tokens >= t plus K * t, for any t (here top_p / 4K, so a flat row's bound falls short)
    t = top_p / (4 * TOP_P_CANDIDATES)
    peaked = torch.where(rows >= t, rows, 0.0).sum(dim=-1) + TOP_P_CANDIDATES * t >= top_p
    covered = torch.zeros(rows.shape[0], dtype=torch.bool)
    if peaked.any():
        index = peaked.nonzero()[:, 0]
        top = torch.topk(rows[index], TOP_P_CANDIDATES, dim=-1)  # sorted, most likely first
        cum = torch.cumsum(top.values, dim=-1)
        done = cum[:, -1] > top_p
        keep = torch.zeros((len(index), rows.shape[-1]), dtype=torch.bool).scatter(-1, top.indices,
                                                                                   cum - top.values < top_p)
        drop[index[done]] = ~keep[done]
        covered[index[done]] = True
    if not covered.all():
        rest = (~covered).nonzero()[:, 0]
        drop[rest] = _top_p_drop(rows[rest], top_p)
    return drop.view(probs.shape)
