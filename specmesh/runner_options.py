"""The fast runner's options and the CPU features its tuning keys on, named once, without torch.

``models.py`` builds the command line's model options from them without importing torch (``--help`` stays
fast); the runner resolves them (``fast_llama.attention_backend`` and ``compile_choice``,
``cuda_graphs.graph_choice``), and ``cpu_platform.py`` picks its matrix products by the CPU's flags.
"""

from __future__ import annotations

import functools
from pathlib import Path

ATTENTION_BACKENDS = ("auto", "sdpa", "triton")  # the fast runner's attention (fast_llama.attention_backend)
COMPILE_MODES = ("auto", "on", "off", "frozen")  # its torch.compile of its layers (fast_llama.compile_choice)
GRAPH_MODES = ("auto", "on", "off")  # its CUDA graphs (cuda_graphs.graph_choice)
ATTENTION_ENV = "SPECMESH_ATTENTION"  # what ``auto`` means when set (e.g. triton, to force the kernel in tests)
COMPILE_ENV = "SPECMESH_COMPILE"  # what ``compile_layers="auto"`` means when set (on / off)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``avx512_bf16``, ``amx_bf16``, ...); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_has_fast_bf16() -> bool:
    """True on x86 CPUs whose matmuls run natively in bfloat16 (AVX512-BF16 or AMX), where a bf16 draft is
    about twice as fast as float32. Elsewhere bf16 is emulated and slower."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
