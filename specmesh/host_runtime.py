"""The host runtime of a process that runs a model: glibc's malloc thresholds and Python's cyclic GC.

**malloc.** A verify step of many sessions allocates a few host tensors of 1-10 MB (the logits, the gathered
keys of the padded attention, the MLP's activations) and frees them at its end. glibc serves an allocation
above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) with a fresh ``mmap`` and trims the top of
its heaps past the trim threshold, so such tensors come back from the kernel as untouched pages step after
step: every first touch of a page is a fault. Measured on this project's 2-core VM (1-layer 128-wide Llama,
64 sessions of ~150 positions, one verify step): 10.5 ms per step with glibc's defaults, 5.3 ms with the
thresholds below, the same as with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` set in the
environment. vLLM and SGLang advise preloading tcmalloc on CPUs for the same reason; ``tune_host_allocator``
is the glibc equivalent, applied when a process that runs a model starts (``specmesh`` commands, Ray Serve
replicas, the benchmarks). The cost: memory a process freed stays in its heap (its high-water mark) instead of
going back to the system. ``SPECMESH_MALLOC_TUNE=0`` turns it off; it is skipped where the user already chose
(either ``MALLOC_*`` variable set, or another allocator in ``LD_PRELOAD``) and off glibc.

**GC.** The engine builds a few small objects per request and step (stats, events), so the cyclic GC runs
often, and now and then a full collection walks every object the process holds: the model stack's imports
(torch, transformers) are hundreds of thousands. Measured the same way: one full collection took 0.2 s of a
1.1 s run of 64 requests. ``freeze_heap`` (``gc.freeze`` after a ``gc.collect``, as vLLM does once its engine
is built) moves what start-up built out of the collector's sight, so a collection only walks what serving
allocated since: the same run spent 7 ms in the GC. Servers call it once everything is loaded, right before
they serve (``specmesh.serving.serve``); ``generate``/``bench`` once their models are loaded.
``SPECMESH_GC_FREEZE=0`` turns it off.

**Exit.** A loop thread (the engine core's, a replica's step loop) is a daemon: a process never waits for it.
But one that is still running when the interpreter finalizes, as it may be just after its last request's
output woke the main thread, can be freeing a step's tensors: torch releases the interpreter lock while it frees
one, and a daemon thread that takes the lock back during finalization is ended with a forced unwind through
C++ frames that do not allow it, and the process aborts (SIGABRT, "terminate called without an active
exception"; pytorch/pytorch#38228). ``close_at_exit`` registers such a loop to be closed (its thread joined)
before finalization begins.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import os
import platform
import weakref

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # allocations below this come from the heap (larger ones: model weights, the KV pool)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of a heap before it is given back

_done: bool | None = None
_unfreeze_at_exit = False


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). True when they were set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if _off("SPECMESH_MALLOC_TUNE"):
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


def _off(variable: str) -> bool:
    return os.environ.get(variable, "1").lower() in ("0", "false", "no", "off")


def freeze_heap() -> bool:
    """Collect, then freeze every object alive now out of the cyclic GC's generations (objects start-up built
    and serving keeps). True when frozen (``SPECMESH_GC_FREEZE=0``: not). Frozen objects are still freed by
    reference counting; only cycles among them outlive their use, so call it once the process is built."""
    if _off("SPECMESH_GC_FREEZE"):
        return False
    gc.collect()
    gc.freeze()
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:  # at exit the frozen objects go back to the collector, so finalization frees them
        _unfreeze_at_exit = True  # (else extension types report them as leaks: nanobind's "leaked instances")
        atexit.register(gc.unfreeze)
    return True


__all__ = ["freeze_heap", "tune_host_allocator"]


_AT_EXIT: weakref.WeakSet = weakref.WeakSet()  # loops to close before the interpreter finalizes (module doc)


def close_at_exit(loop) -> None:
    """Call ``loop.close()`` (which joins its thread) at exit unless it is gone by then (module doc, "Exit")."""
    _AT_EXIT.add(loop)


@atexit.register
def _close_loops() -> None:
    for loop in list(_AT_EXIT):
        try:
            loop.close()
        except Exception:  # closing is best effort: the process is ending
            pass
