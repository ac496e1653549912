"""The host runtime of processes that run a model: glibc's tuning takes effect, once, and never where the user
chose; the heap freeze hides what was built from the cyclic GC, unless turned off.

Each case runs in a fresh interpreter (the thresholds are process-wide). The effect is read back from
glibc itself: an 8 MiB block (above glibc's default mmap threshold, below the tuned one) is mapped on its
own unless the tuning is on, which ``malloc_info``'s count of mmapped blocks shows (before and after).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, json, os, sys
os.environ.update(json.loads(sys.argv[1]))
from specmesh.host_runtime import MMAP_THRESHOLD, tune_host_allocator
first, again = tune_host_allocator(), tune_host_allocator()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fmemopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
buf = ctypes.create_string_buffer(1 << 16)

def mapped():  # blocks malloc has mapped on their own (the last total of malloc_info: the whole process)
    stream = libc.fmemopen(buf, len(buf), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    return int(buf.value.decode().rsplit('<total type="mmap" count="', 1)[1].split('"')[0])

size = 8 << 20
assert size < MMAP_THRESHOLD
before = mapped()
block = libc.malloc(size)
after = mapped()
libc.free(block)
print(json.dumps({"first": first, "again": again, "mapped": after - before}))
"""

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="tunes glibc only")


def _probe(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("SPECMESH_MALLOC_TUNE", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(env)], env=clean, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_tuned_once_and_a_large_block_stays_in_the_heap():
    assert _probe({}) == {"first": True, "again": True, "mapped": 0}


@pytest.mark.parametrize("env", [{"SPECMESH_MALLOC_TUNE": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"}, {"LD_PRELOAD": "libjemalloc.so.2"}],
                         ids=["opted-out", "trim-set", "mmap-set", "other-allocator"])
def test_left_alone_where_the_user_chose(env):
    # the variables are set after start-up, so glibc itself still runs on its defaults: the block is mapped
    assert _probe(env) == {"first": False, "again": False, "mapped": 1}


FREEZE_PROBE = """
import gc, json, os, sys
os.environ.update(json.loads(sys.argv[1]))
from specmesh.host_runtime import freeze_heap
built = [[i] for i in range(1000)]  # what start-up built
frozen = freeze_heap()
print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count() >= len(built)}))
"""


@pytest.mark.parametrize(("env", "frozen"), [({}, True), ({"SPECMESH_GC_FREEZE": "0"}, False)], ids=["on", "off"])
def test_freeze_heap_hides_what_was_built(env, frozen):
    clean = {k: v for k, v in os.environ.items() if k != "SPECMESH_GC_FREEZE"}
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE, json.dumps(env)], env=clean, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"frozen": frozen, "count": frozen}
