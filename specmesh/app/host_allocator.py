"""Keep glibc's malloc from returning the step's tensors to the kernel after every step.

A verify step of many sessions allocates a few host tensors of 1-10 MB (the logits, the gathered keys of the
padded attention, the MLP's activations) and frees them at its end. glibc serves an allocation above its mmap
threshold (128 KiB, raised on the fly up to 32 MiB) with a fresh ``mmap`` and trims the top of its heaps past
the trim threshold, so such tensors come back from the kernel as untouched pages step after step: every first
touch of a page is a fault. Measured on this project's 2-core VM (1-layer 128-wide Llama, 64 sessions of ~150
positions, one verify step): 10.5 ms per step with glibc's defaults, 5.3 ms with the thresholds below, the
same as with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` set in the environment. vLLM and SGLang
advise preloading tcmalloc on CPUs for the same reason; this is the glibc equivalent, applied when a process
that runs a model starts (``specmesh`` commands, Ray Serve replicas, the benchmarks).

The cost: memory a process freed stays in its heap (its high-water mark) instead of going back to the system.
``SPECMESH_MALLOC_TUNE=0`` turns it off; it is skipped where the user already chose (either ``MALLOC_*``
variable set, or another allocator in ``LD_PRELOAD``) and off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # allocations below this come from the heap (larger ones: model weights, the KV pool)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of a heap before it is given back

_done: bool | None = None


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). True when they were set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("SPECMESH_MALLOC_TUNE", "1").lower() in ("0", "false", "no", "off"):
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # the user set them
    if any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                          TRIM_THRESHOLD))
    except (OSError, AttributeError) as exc:  # no libc to load, or no mallopt in it
        log.debug("malloc thresholds left as they are: %s", exc)
    return _done


__all__ = ["tune_host_allocator"]
