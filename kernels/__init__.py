"""Triton kernels. One file per kernel: the ``@triton.jit`` kernel, its launcher (shape, stride, dtype
checks; the grid) and a PyTorch reference of the same op (docs/ARCHITECTURE.md, "Kernels").

Importing this package imports no triton: import a kernel's module (``kernels.tree_attention``) to use it.
"""
