"""Counting the host's reads of device results on a machine without a device (a development instrument).

On an accelerator, every read of a device tensor by the host (``.cpu()``, ``.tolist()``, ``.item()``, ``bool()``,
``nonzero``, boolean-mask indexing...) makes the host wait for the device. On the CPU nothing waits, so such reads
are invisible; this module makes them visible: ``mark_outputs(runner)`` makes a runner's ``forward_batch`` return
``OnDevice`` tensors, a subclass every result computed from them keeps, and every host read of one is recorded
while ``counting()`` is open. Used by ``tests/test_host_transfers.py`` (one read per verifier step and per batched
draft step) and ``benchmarks/host_transfers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

READS = frozenset({"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__",
                   "nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "nonzero_static"})


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on an accelerator: host reads of it and of its descendants are recorded."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS or name == "to" and _to_host(args, kwargs)
                or name in ("__getitem__", "__setitem__") and _boolean_index(args[1])):
            cls.reads.append(name)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out  # on the host now
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, str | torch.device)), None))
    return target is not None and torch.device(target).type == "cpu"


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def mark_outputs(runner):
    """``runner`` (changed in place, returned), its ``forward_batch`` outputs (logits, features) ``OnDevice``."""
    forward = runner.forward_batch

    def forward_batch(*args, **kwargs):
        out = forward(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(t.as_subclass(OnDevice) for t in out)
        return out.as_subclass(OnDevice)

    runner.forward_batch = forward_batch
    return runner


@contextlib.contextmanager
def counting() -> Iterator[list[str]]:
    """The host reads of ``OnDevice`` tensors made inside the block, by name, in order."""
    OnDevice.reads = []
    yield OnDevice.reads
