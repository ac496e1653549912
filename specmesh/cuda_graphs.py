"""CUDA graphs for the fast runner's steps over a paged KV pool (issue 32 item 3).

On a GPU the eager forward is bound by the host: every layer launches ~30 kernels from Python, and a
Llama-3.2-1B-shaped model's step took ~16 ms on an H100 whose weights read in 0.8 ms
(benchmarks/results/gpu_h100.md). A CUDA graph records the stack's launches once and replays them with one call.

What a graph needs is fixed shapes and fixed addresses, so a step is padded to a *bucket* and runs on *static
buffers*:

* bucket = (rows T, sessions S, rows of the longest session N, key shares K), each of T, S, N rounded up its
  ladder (``ROW_BUCKETS``, ``SESSION_BUCKETS``, ``NEW_BUCKETS``); the tree-attention kernel's grid and tile follow
  S, N and K (split-KV: a power of two from the longest session, ``kernels.tree_attention.kv_splits``), the dense
  layers follow T. Steps past the ladders' tops, with more than ``MASK_WORDS`` words of ancestor bits, or with a
  table longer than the pool's longest session run eager.
* static buffers, one set per pool: token ids and positions [T_max], the kernel's row offsets, lengths and tree
  starts (one int32 vector at fixed 16-byte-aligned offsets), block tables [S_max, max blocks], write slots
  [T_max], ancestor words [T_max, MASK_WORDS]; and the logits of all T rows [T_max, vocab] float32, which every
  graph writes (one buffer for all buckets: a graph's own output would cost T x vocab per captured bucket).
* padding: rows past the step's are token 0 at position 0 writing the pool's scratch slot (``KVPool.scratch_slot``,
  in no table, never read); sessions past the step's have no rows (their offsets repeat the last) and length 0, so
  the kernel's programs for them exit at once. Padded rows go through the dense layers like real ones (row-wise:
  they cannot change a real row) and their logits are dropped.

A pool's plain-decoding buckets (one row per session) are captured when the pool is built (``PoolGraphs.warm``,
after the check below), so no decode step pays a capture mid-serving; other buckets (verify steps, prompt chunks)
on first use. Each capture follows one eager warm-up run on a side stream (which also compiles anything
``torch.compile`` has left to compile). Before the first capture, ``PoolGraphs.check``
holds a replayed step to the eager forward on a probe session (prefill, then one decode row both ways): a
mismatch or failure raises under ``cuda_graphs="on"`` and turns graphs off, with a warning, under ``auto``.

Off CUDA there is nothing to capture: ``capture=False`` runs the same padded step on the same static buffers
eagerly (what the CPU tests check, with the kernel under the Triton interpreter).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from specmesh.kernel_attention import KernelAttention, KernelMetadata, KernelRunner, kernel_metadata
from specmesh.runner_options import GRAPH_MODES

if TYPE_CHECKING:
    from specmesh.contract import ModelInfo
    from specmesh.kv_pool import KVPool

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
NEW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MASK_WORDS = 4  # ancestor bits for up to 128 tree columns (a verify tree plus a lookahead window)
ALIGN = 4  # int32 elements per 16 bytes: the kernel compiles a variant per pointer alignment
# the start-up check's tolerance on the probe's logits, relative to their largest value: the graph replays the
# same kernels on the same rows, but a padded batch may pick other GEMM tilings than the eager one
CHECK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class GraphRunner(KernelRunner, Protocol):
    """What the graphs read of their runner (``fast_llama.FastLlamaRunner``, which imports this module)."""

    info: ModelInfo
    dtype: torch.dtype
    lm_head: torch.Tensor  # [hidden, vocab]

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, attention, logit_rows=None, hidden_rows=None):
        """The stack over packed rows ids/pos [T]: (logits [R, vocab] float32, features or None)."""
        ...

    def _to_device(self, values: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ...

    def forward_eager(self, cache, input_ids: Sequence[int], position_ids: Sequence[int]) -> torch.Tensor:
        ...


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (the start-up checks of compiled layers and CUDA graphs)."""
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def graph_choice(choice: str, device: torch.device, attention: str) -> str | None:
    """Resolve ``cuda_graphs`` (one of GRAPH_MODES) to ``on``, ``auto`` (on, falling back to eager if the start-up
    check fails) or None (off). Graphs need the kernel attention (``attention`` = triton); ``auto`` takes them on
    CUDA only, ``on`` on any device (off CUDA: the padded static-buffer step without capture, for tests)."""
    if choice not in GRAPH_MODES:
        raise ValueError(f"unknown cuda-graphs mode {choice!r}; choose one of {GRAPH_MODES}")
    if choice == "off" or attention != "triton":
        if choice == "on" and attention != "triton":
            raise ValueError("CUDA graphs replay the tree-attention kernel: they need --attention triton (auto on CUDA)")
        return None
    if choice == "auto" and device.type != "cuda":
        return None
    return choice


def bucket(value: int, ladder: Sequence[int]) -> int | None:
    """The smallest rung >= value, None past the top."""
    i = bisect_left(ladder, value)
    return ladder[i] if i < len(ladder) else None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PoolGraphs:
    """One pool's static buffers and captured graphs, keyed by bucket (T, S, N)."""

    def __init__(self, runner: GraphRunner, pool: KVPool, capture: bool, required: bool = False) -> None:
        self.runner, self.pool, self.capture, self.required = runner, pool, capture, required
        self.failed = False  # a capture failed under ``auto``: every later step of this pool runs eager
        device = pool.device
        self.max_rows, self.max_sessions = ROW_BUCKETS[-1], SESSION_BUCKETS[-1]
        self.max_blocks = -(-runner.info.max_positions // pool.block_size)
        self.ids = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.pos = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.words = torch.zeros(self.max_rows, MASK_WORDS, dtype=torch.int32, device=device)
        self.tables = torch.zeros(self.max_sessions, self.max_blocks, dtype=torch.int32, device=device)
        # row offsets [S_max + 1] | lengths [S_max] | tree starts [S_max], each at a 16-byte offset
        self.offsets = (0, _aligned(self.max_sessions + 1), _aligned(self.max_sessions + 1) + _aligned(self.max_sessions))
        self.small_host = np.zeros(self.offsets[2] + _aligned(self.max_sessions), np.int32)
        self.small = torch.zeros(len(self.small_host), dtype=torch.int32, device=device)
        self.logits = torch.empty(self.max_rows, runner.lm_head.shape[1], dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph | None] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by this pool's graphs (tests, stats)
        self.eager = 0  # steps that fit no bucket (a long prompt chunk, a tree past the ladders) and ran eager
        self.captures, self.capture_seconds = 0, 0.0  # buckets captured (warm-up run included) and their time

    # ------------------------------------------------------------ the step
    def key(self, meta: KernelMetadata, num_new: Sequence[int]) -> tuple[int, int, int, int] | None:
        """The step's bucket (T, S, N, K), or None when it does not fit the static buffers (it then runs eager)."""
        if meta.words.shape[1] > MASK_WORDS or meta.tables.shape[1] > self.max_blocks:
            return None
        return self._key(int(meta.cu_q[-1]), len(num_new), max(num_new), int(meta.kv_len.max()))

    def _key(self, rows: int, sessions: int, longest: int, keys: int) -> tuple[int, int, int, int] | None:
        """The bucket of ``rows`` rows of ``sessions`` sessions, the largest feeding ``longest`` rows, the longest
        attending to ``keys`` keys; None past a ladder's top."""
        t, s, n = bucket(rows, ROW_BUCKETS), bucket(sessions, SESSION_BUCKETS), bucket(longest, NEW_BUCKETS)
        if t is None or s is None or n is None:
            return None
        s, n = min(s, t), min(n, t)
        return t, s, n, self.runner._kv_splits(n, s, keys)

    def decode_keys(self) -> list[tuple[int, int, int, int]]:
        """Every bucket a plain decoding step can fall in (S sessions of one row each, up to the top rung; every key
        share count K its sessions' lengths up to the model's context can pick: K grows with the longest session's
        keys through every power of two up to the one at the full context), in capture order."""
        keys = set()
        for sessions in range(1, self.max_sessions + 1):
            top = self._key(sessions, sessions, 1, self.runner.info.max_positions)
            keys.update(top[:3] + (1 << i,) for i in range(top[3].bit_length()))
        return sorted(keys)

    def warm(self) -> int:
        """Capture every plain-decoding bucket now (``decode_keys``); returns how many were new. A failed capture
        raises if graphs are ``required``, else turns this pool's graphs off with a warning, as mid-serving."""
        start, new = time.perf_counter(), [key for key in self.decode_keys() if key not in self.graphs]
        for key in new:
            if not self._capture(key):
                return 0
        if self.capture:
            log.info("captured %d plain-decoding CUDA graphs in %.1f s", len(new), time.perf_counter() - start)
        return len(new)

    def forward(self, meta: KernelMetadata, ids: torch.Tensor, pos: torch.Tensor, num_new: Sequence[int]):
        """The step's logits [T, vocab] float32 (a fresh tensor) from the bucket's graph, or None when the step
        does not fit one. ``meta``: the step's kernel metadata (its caches already hold the step's blocks; their
        lengths are the caller's to advance)."""
        if self.failed:
            return None
        key = self.key(meta, num_new)
        if key is None:
            self.eager += 1
            return None
        if key not in self.graphs and not self._capture(key):
            return None
        graph = self.graphs[key]
        self._fill(meta, ids, pos, key)
        if graph is not None:
            graph.replay()
        else:
            self._body(key)
        self.replays += 1
        return self.logits[: int(meta.cu_q[-1])].clone()

    def _fill(self, meta: KernelMetadata, ids: torch.Tensor, pos: torch.Tensor, key: tuple[int, ...]) -> None:
        """Write the step into the static buffers, padded to ``key`` (host data crosses without waiting)."""
        rows, sessions = int(meta.cu_q[-1]), len(meta.kv_len)
        t, s = key[:2]
        small = self.small_host
        small[:] = 0
        a, b, c = self.offsets
        small[a : a + sessions + 1] = meta.cu_q
        small[a + sessions + 1 : a + s + 1] = rows  # padded sessions: no rows
        small[b : b + sessions] = meta.kv_len
        small[c : c + sessions] = meta.tree_start
        self.small.copy_(torch.from_numpy(small), non_blocking=True)
        self.ids[:rows].copy_(ids, non_blocking=True)
        self.pos[:rows].copy_(pos, non_blocking=True)
        if t > rows:
            self.ids[rows:t].zero_()
            self.pos[rows:t].zero_()
        slots = np.full(t, self.pool.scratch_slot, np.int64)
        slots[:rows] = meta.slots
        self.slots[:t].copy_(torch.from_numpy(slots), non_blocking=True)
        if meta.has_tree:
            words = np.zeros((rows, MASK_WORDS), np.int32)
            words[:, : meta.words.shape[1]] = meta.words
            self.words[:rows].copy_(torch.from_numpy(words), non_blocking=True)
        blocks = meta.tables.shape[1]
        self.tables[:sessions, :blocks].copy_(torch.from_numpy(meta.tables.astype(np.int32)), non_blocking=True)

    def _body(self, key: tuple[int, int, int, int]) -> None:
        """The padded step on the static buffers, its logits into ``self.logits[:T_bucket]``. What a graph records."""
        t, s, n, splits = key
        a, b, c = self.offsets
        attention = KernelAttention.of(
            self.runner, self.pool.keys, self.pool.values, self.pool.block_size, self.small[a : a + s + 1],
            self.small[b : b + s], self.small[c : c + s], self.tables[:s], self.slots[:t], self.words[:t], n, splits,
        )
        self.logits[:t].copy_(self.runner._layers(self.ids[:t], self.pos[:t], attention)[0])

    def _capture(self, key: tuple[int, int, int, int]) -> bool:
        """``_record`` the bucket; False when it cannot be captured: this pool's steps run eager from then on (a
        warning), unless graphs were required (then it raises)."""
        try:
            self._record(key)
        except Exception as exc:
            if self.required:
                raise
            log.warning("capturing a CUDA graph for bucket %s failed, this pool's steps run eager: %s", key, exc)
            self.failed = True
            return False
        return True

    def _record(self, key: tuple[int, int, int, int]):
        """Capture the bucket's graph (CUDA) on safe buffers: every row writes the scratch slot, every session is
        empty, so the warm-up run changes nothing the pool's sessions read."""
        self.slots.fill_(self.pool.scratch_slot)
        self.small.zero_()
        graph, start = None, time.perf_counter()
        if self.capture:
            device = self.pool.device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._body(key)  # warm-up: lazy initialisation and compilation happen outside the capture
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                self._body(key)
            log.debug("captured a CUDA graph: %d rows, %d sessions, %d rows per session, %d key shares", *key)
        self.graphs[key] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        return graph

    # ------------------------------------------------------------ the start-up check
    @torch.inference_mode()
    def check(self) -> bool:
        """Hold a graphed decode step to the eager one on a probe session of this pool: True when they agree. A
        failure or mismatch raises if graphs are ``required``, else logs a warning and returns False."""
        runner = self.runner
        try:
            cache = self.pool.open(8)
        except Exception:  # a pool with no room for the probe: nothing to check against now, try the graphs
            return True
        try:
            runner.forward_eager(cache, [1, 2, 3, 4, 5, 6, 7], list(range(7)))
            want = runner.forward_eager(cache, [8], [7])
            cache.truncate(7)
            ids, pos = runner._to_device([8]), runner._to_device([7])
            got = self.forward(kernel_metadata(runner, [cache], [1], [None]), ids, pos, [1])
            error = relative_error(got, want)
            if not error <= CHECK_TOLERANCE.get(runner.dtype, 3e-2):
                raise ValueError(f"a replayed step differs from the eager one: relative error {error:.2g}")
        except Exception as exc:
            if self.required:
                raise
            log.warning("CUDA graphs are off, the steps run eager: %s", exc)
            return False
        finally:
            cache.free()
        log.info("CUDA graphs on for a pool of %d blocks (decode buckets captured now, the others on first use)",
                 self.pool.allocator.num_blocks)
        return True


__all__ = ["PoolGraphs", "bucket", "graph_choice", "relative_error"]
