"""The Triton interpreter without its per-call re-patching, for the kernel tests on a machine without a GPU.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` once (``_patch_lang``: every builtin wrapped for
the interpreter, restored when the launch ends), and then every call of a ``@triton.jit`` device function inside
the kernel patches it again: ``tl.max``, ``tl.sum``, ``tl.cdiv`` are such functions, and each re-patch walks the
language modules with ``inspect.getmembers`` (~1 ms). In the split-KV combine kernel that was 3,100 re-patches in
one call, 40% of its time. The wrappers a re-patch installs are the ones already installed (stateless lambdas over
the same builtins and builder), so a launch here patches each language module once and skips the repeats; the
outputs are bit-identical (checked on the tree-attention cases). Triton 3.9 has no switch for this."""

from __future__ import annotations

import threading


def install() -> bool:
    """Patch the installed Triton's interpreter (False where it has no ``_patch_lang`` to wrap)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_specmesh_once", False):
        return original is not None
    launch = threading.local()  # the language modules the running launch has patched (None: no launch)

    def modules_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}

    def patch_lang(fn):
        patched = getattr(launch, "modules", None)
        wanted = modules_of(fn)
        if patched is not None and wanted <= patched:
            return interpreter._LangPatchScope()  # already patched for this launch: nothing to restore
        scope = original(fn)
        if patched is None:  # a launch starts (GridExecutor): it ends when its scope is restored
            launch.modules = set(wanted)
            restore = scope.restore

            def restore_and_end():
                launch.modules = None
                restore()

            scope.restore = restore_and_end
        else:  # a device function of another module inside the launch (Triton itself never restores these)
            patched |= wanted
        return scope

    patch_lang._specmesh_once = True
    interpreter._patch_lang = patch_lang
    return True
