"""``row_ops.argmax_last`` (numpy's argmax on the CPU) is torch's ``argmax(dim=-1)``: values, ties, NaN, shapes;
``row_ops.pack`` and ``kv_pool.write_slots`` (a step's packed ids, positions and slots) are the concatenations they
stand for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.host_reads import OnDevice, counting
from specmesh.kv_pool import KVPool, PagedKVCache, write_slots
from specmesh.row_ops import argmax_last, pack


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


def test_pack_is_the_concatenation_with_ints_as_one_element():
    rng = np.random.default_rng(3)
    for _ in range(200):
        parts = []
        for _ in range(int(rng.integers(0, 12))):
            kind = rng.integers(0, 3)
            if kind == 0:
                parts.append(int(rng.integers(-5, 1000)))
            elif kind == 1:
                parts.append(np.int64(rng.integers(0, 1000)))  # a numpy scalar is an int too
            else:
                parts.append(rng.integers(0, 1000, int(rng.integers(0, 5))))  # arrays, empty ones included
        want = np.concatenate([np.atleast_1d(np.asarray(p, np.int64)) for p in parts] or [np.zeros(0, np.int64)])
        got = pack(parts)
        assert got.dtype == np.int64 and np.array_equal(got, want)


def test_write_slots_are_the_sessions_slots_of_their_new_rows():
    """Fragmented tables, sessions of one row (integer arithmetic) and of several (array slices), mixed."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=64, block_size=4)
    rng = np.random.default_rng(5)
    free = list(rng.permutation(64).tolist())
    caches, starts, num_new = [], [], []
    for _ in range(12):
        n = int(rng.choice([1, 1, 3, 6]))
        start = int(rng.integers(0, 14))
        table = [free.pop() for _ in range(-(-(start + n) // 4))]
        cache = PagedKVCache(pool, table)
        caches.append(cache)
        starts.append(start)
        num_new.append(n)
    want = np.concatenate([c.host_slots[a : a + n] for c, a, n in zip(caches, starts, num_new, strict=True)])
    assert np.array_equal(write_slots(caches, starts, num_new), want)
