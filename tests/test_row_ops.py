"""``row_ops.argmax_last`` (numpy's argmax on the CPU) is torch's ``argmax(dim=-1)``: values, ties, NaN, shapes."""

from __future__ import annotations

import pytest
import torch

from specmesh.host_reads import OnDevice, counting
from specmesh.row_ops import argmax_last


@pytest.mark.parametrize("shape", [(7,), (5, 33), (2, 3, 40), (1, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_argmax_last_equals_torch(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randint(0, 4, shape, generator=gen) if dtype == torch.int64
         else torch.randn(shape, generator=gen)).to(dtype)  # int64 in [0, 4): many ties
    for keepdim in (False, True):
        got, want = argmax_last(x, keepdim), x.argmax(dim=-1, keepdim=keepdim)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want)


def test_argmax_last_ties_nan_and_strided_views():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 2.0, float("nan"), 9.0], [-float("inf")] * 4])
    assert argmax_last(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 0]  # first max; the first NaN wins
    wide = torch.randn(6, 50)
    view = wide[::2, 3:41]  # not contiguous
    assert torch.equal(argmax_last(view), view.argmax(dim=-1))
    with torch.inference_mode():
        assert torch.equal(argmax_last(wide), wide.argmax(dim=-1))


def test_argmax_last_keeps_torch_where_numpy_cannot_serve():
    bf16 = torch.randn(3, 17).to(torch.bfloat16)
    assert torch.equal(argmax_last(bf16), bf16.argmax(dim=-1))
    on_device = torch.randn(3, 17).as_subclass(OnDevice)  # a stand-in for an accelerator's tensor: no host read
    with counting() as reads:
        out = argmax_last(on_device)
    assert isinstance(out, OnDevice) and reads == []
    assert torch.equal(out.as_subclass(torch.Tensor), on_device.as_subclass(torch.Tensor).argmax(dim=-1))
