"""The tree-attention kernel against PyTorch SDPA with an explicit mask and against the KV-read bound.

    python benchmarks/tree_attention.py --json benchmarks/results/tree_attention_h100.json
    python benchmarks/tree_attention.py --smoke   # a tiny grid on CPU under the Triton interpreter

The verify step's attention: B requests, each ``nodes`` new rows (a random tree) over a ``prefix``
of cached positions, in a paged pool (block size 16) whose blocks are handed out shuffled, so every
request's table is scattered. Default grid: batch {1, 8, 32} x prefix {1024, 4096} x nodes {1, 16,
64} with Llama-8B attention (32 query heads, 8 KV heads, head dim 128, bf16). Per point:

* kernel: ``kernels.tree_attention.tree_attention``, one launch for the batch, keys/values read
  through the block tables (the runner's triton path per layer, less its K/V scatter).
* sdpa_loop: the runner's SDPA path, one ``F.scaled_dot_product_attention`` per request with its
  dense [nodes, prefix + nodes] bool mask, on keys/values laid out contiguously per request (its
  best case: a scattered table would add a gather, not timed here).
* sdpa_batched: one SDPA call over [B, kv_heads, prefix + nodes, head_dim] keys/values (gathered
  beforehand, not timed) with a [B, 1, nodes, prefix + nodes] mask: what a padded batch could do.
* kernel split: the same launch with its keys shared among K programs (split-KV; K as the runner picks it
  for this GPU, ``kernels.tree_attention.kv_splits``; K = 1: the kernel's time again), checked against
  sdpa_loop too.
* bound: bytes of K and V the step must read (B x kv_heads x (prefix + nodes) x head_dim x 2 x
  element size) / the device's copy bandwidth, measured with a large device-to-device copy
  (2 x bytes / time: each byte is read once and written once).

Before timing, the kernel's output is checked against sdpa_loop's. Times: the median of
``triton.testing.do_bench`` on CUDA (CUDA events), of wall-clock repeats on CPU. A launch from Python costs
tens of microseconds of host time, more than the whole kernel at batch 1, so on CUDA the kernel (whole and
split) and sdpa_batched are also timed replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``,
columns "graphed"): the device's own time, and how the engine runs them (specmesh/cuda_graphs.py). Writes the JSON
(--json) with a markdown table beside it (same name, .md), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# -------------------------------------------------------------------------------------- inputs
def random_ancestors(num_nodes: int, rng: random.Random) -> torch.Tensor:
    """[num_nodes, num_nodes] bool of a random tree (parents[i] < i): row i = i and its ancestors."""
    anc = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        parent = rng.randrange(-1, i)
        if parent >= 0:
            anc[i] = anc[parent]
        anc[i, i] = True
    return anc


def make_point(batch: int, prefix: int, nodes: int, args, rng: random.Random, device: torch.device) -> dict:
    """The kernel's arguments for one grid point, plus the same keys/values and masks laid out for SDPA."""
    from kernels.tree_attention import pack_tree_mask

    dtype, size = DTYPES[args.dtype], args.block_size
    kv_len = prefix + nodes
    per_request = -(-kv_len // size)
    order = list(range(batch * per_request))
    rng.shuffle(order)
    gen = torch.Generator(device="cpu").manual_seed(rng.randrange(2**31))
    shape = (args.kv_heads, batch * per_request * size, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    tables = torch.tensor(order, dtype=torch.int32).view(batch, per_request)
    ancestors = [random_ancestors(nodes, rng) for _ in range(batch)]
    q = torch.randn(batch * nodes, args.heads, args.head_dim, generator=gen).to(device=device, dtype=dtype)
    positions = torch.arange(kv_len)
    slots = (tables.long()[:, positions // size] * size + positions % size).to(device)  # [B, kv_len]
    dense = torch.stack([torch.cat([torch.ones(nodes, prefix, dtype=torch.bool), a], 1) for a in ancestors])
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "kernel": dict(
            q=q, k_cache=k_cache, v_cache=v_cache,
            cu_q=torch.arange(0, (batch + 1) * nodes, nodes, **i32),
            kv_len=torch.full((batch,), kv_len, **i32), tree_start=torch.full((batch,), prefix, **i32),
            block_tables=tables.to(device), block_size=size,
            mask=torch.cat([pack_tree_mask(a) for a in ancestors]).to(device), max_num_new=nodes,
        ),
        # SDPA's layout: [B, heads, nodes, head_dim] queries, [B, kv_heads, kv_len, head_dim] keys/values
        "q": q.view(batch, nodes, args.heads, args.head_dim).transpose(1, 2).contiguous(),
        "keys": torch.stack([k_cache[:, s] for s in slots]),
        "values": torch.stack([v_cache[:, s] for s in slots]),
        "mask": dense.to(device),  # [B, nodes, kv_len]
        "kv_bytes": 2 * batch * args.kv_heads * kv_len * args.head_dim * k_cache.element_size(),
    }


# -------------------------------------------------------------------------------------- timing
def time_ms(fn, device: torch.device, args) -> float:
    """Median milliseconds of one call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(args.cpu_repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, device: torch.device, args) -> float | None:
    """Median milliseconds of one call replayed from a CUDA graph (no launch overhead); None off CUDA or when the
    call cannot be captured (said on stderr)."""
    if device.type != "cuda":
        return None
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median"))
    except Exception as exc:  # noqa: BLE001 (a capture failure leaves the launch-timed column)
        print(f"could not time {getattr(fn, '__name__', fn)} from a CUDA graph: {exc}", file=sys.stderr)
        return None


def copy_bandwidth(device: torch.device, num_bytes: int, args) -> float:
    """Bytes per second of a device-to-device copy (each byte read once, written once)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, args)
    return 2 * num_bytes / (ms * 1e-3)


# ------------------------------------------------------------------------------------------ run
def run_point(batch: int, prefix: int, nodes: int, args, rng: random.Random, device: torch.device,
              bandwidth: float) -> dict:
    from kernels.tree_attention import kv_splits, num_programs, tree_attention

    point = make_point(batch, prefix, nodes, args, rng, device)
    # split-KV as the runner picks it (this GPU's SMs; the smoke run on a CPU takes an H100's 132)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    splits = kv_splits(num_programs(args.heads, args.kv_heads, nodes, args.head_dim, batch), prefix + nodes, sms)
    kernel_args, q, keys, values, mask = (point[k] for k in ("kernel", "q", "keys", "values", "mask"))
    group = args.heads > args.kv_heads

    def kernel():
        return tree_attention(**kernel_args)

    def kernel_split():
        return tree_attention(**kernel_args, kv_splits=splits)

    def sdpa_loop():
        return [F.scaled_dot_product_attention(q[r], keys[r], values[r], attn_mask=mask[r], enable_gqa=group)
                for r in range(batch)]

    def sdpa_batched():
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=group)

    want = torch.stack(sdpa_loop()).float()
    tol = 2e-2 if DTYPES[args.dtype] != torch.float32 else 1e-4
    errors = []
    for name, fn in (("kernel", kernel), (f"kernel with {splits} key shares", kernel_split)):
        err = (fn().view(batch, nodes, args.heads, args.head_dim).transpose(1, 2).float() - want).abs()
        if not bool((err <= tol + tol * want.abs()).all()):
            raise SystemExit(f"{name} != SDPA at batch={batch} prefix={prefix} nodes={nodes}: max error {err.max():.3g}")
        errors.append(float(err.max()))
    row = {"batch": batch, "prefix": prefix, "nodes": nodes, "kv_bytes": point["kv_bytes"],
           "max_abs_err": max(errors), "kv_splits": splits}
    split = [("kernel_split", kernel_split)] if splits > 1 else []  # K = 1: the kernel's launch again
    for name, fn in [("kernel", kernel), ("sdpa_loop", sdpa_loop), ("sdpa_batched", sdpa_batched), *split]:
        row[f"{name}_ms"] = time_ms(fn, device, args)
    row.setdefault("kernel_split_ms", row["kernel_ms"])
    for name, fn in [("kernel", kernel), ("sdpa_batched", sdpa_batched), *split]:
        row[f"{name}_graph_ms"] = graph_ms(fn, device, args)
    row.setdefault("kernel_split_graph_ms", row["kernel_graph_ms"])
    row["bound_ms"] = point["kv_bytes"] / bandwidth * 1e3
    row["sdpa_loop_over_kernel"] = row["sdpa_loop_ms"] / row["kernel_ms"]
    row["sdpa_batched_over_kernel"] = row["sdpa_batched_ms"] / row["kernel_ms"]
    row["kernel_over_bound"] = row["kernel_ms"] / row["bound_ms"]
    row["split_over_bound"] = row["kernel_split_ms"] / row["bound_ms"]
    if row["kernel_graph_ms"] is not None:
        best = min(t for t in (row["kernel_graph_ms"], row["kernel_split_graph_ms"]) if t is not None)
        row["graphed_best_over_bound"] = best / row["bound_ms"]
        row["graphed_sdpa_batched_over_best"] = (row["sdpa_batched_graph_ms"] / best
                                                 if row["sdpa_batched_graph_ms"] is not None else None)
    return row


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"{result['device']}: {cfg['heads']} query heads, {cfg['kv_heads']} KV heads, head dim {cfg['head_dim']}, "
        f"{cfg['dtype']}, block size {cfg['block_size']}; copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s",
        "",
        "| batch | prefix | nodes | kernel ms | SDPA loop ms | SDPA batched ms | bound ms "
        "| SDPA loop / kernel | SDPA batched / kernel | kernel / bound | K | split ms | split / bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["points"]:
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['nodes']} | {r['kernel_ms']:.4f} | {r['sdpa_loop_ms']:.4f} "
                     f"| {r['sdpa_batched_ms']:.4f} | {r['bound_ms']:.4f} | {r['sdpa_loop_over_kernel']:.2f} "
                     f"| {r['sdpa_batched_over_kernel']:.2f} | {r['kernel_over_bound']:.2f} | {r['kv_splits']} "
                     f"| {r['kernel_split_ms']:.4f} | {r['split_over_bound']:.2f} |")
    graphed = [r for r in result["points"] if r.get("kernel_graph_ms") is not None]
    if graphed:
        def ms(x, digits=4):
            return "–" if x is None else f"{x:.{digits}f}"

        lines += ["", "Replayed from a CUDA graph (device time, no launch overhead; best = the faster of whole and "
                      "split):", "",
                  "| batch | prefix | nodes | kernel ms | split ms | SDPA batched ms | bound ms | best / bound "
                  "| SDPA batched / best |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in graphed:
            lines.append(f"| {r['batch']} | {r['prefix']} | {r['nodes']} | {ms(r['kernel_graph_ms'])} "
                         f"| {ms(r['kernel_split_graph_ms'])} | {ms(r['sdpa_batched_graph_ms'])} | {r['bound_ms']:.4f} "
                         f"| {ms(r['graphed_best_over_bound'], 2)} | {ms(r['graphed_sdpa_batched_over_best'], 2)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the results here (and the table beside it, .md)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny grid (4 heads, 2 KV heads, head dim 32, float32) that runs on CPU under the Triton "
                        "interpreter in seconds: checks the script, measures nothing")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="requests per launch")
    p.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096], help="cached positions per request")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 16, 64], help="tree nodes (new rows) per request")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="q/K/V dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV pool block size (positions per block)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy that measures the bandwidth, MiB")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up time per measurement (CUDA)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per measurement (CUDA)")
    p.add_argument("--cpu-repeats", type=int, default=3, help="repeats per measurement on CPU (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trees, tables and tensors")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prefix, args.nodes = [1, 3], [40, 1100], [1, 5]  # 1100: split-KV (K > 1)
        args.heads, args.kv_heads, args.head_dim, args.dtype, args.copy_mib = 4, 2, 32, "float32", 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            raise SystemExit("no CUDA device: the benchmark needs a GPU (--smoke checks the script on CPU)")
        # triton reads this when it is first imported (below, with the kernel): a no-op if it already was
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kernels import tree_attention as kernel_module

    if device.type == "cpu" and not kernel_module.INTERPRETED:
        raise SystemExit("triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1")
    bandwidth = copy_bandwidth(device, args.copy_mib * 2**20, args)
    rng = random.Random(args.seed)
    points = []
    for batch in args.batch:
        for prefix in args.prefix:
            for nodes in args.nodes:
                points.append(run_point(batch, prefix, nodes, args, rng, device, bandwidth))
                print(f"batch={batch} prefix={prefix} nodes={nodes}: kernel {points[-1]['kernel_ms']:.4f} ms",
                      file=sys.stderr)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    result = {
        "device": name + (" [Triton interpreter]" if kernel_module.INTERPRETED else ""),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "config": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "dtype", "block_size", "seed",
                                                 "smoke")},
        "points": points,
    }
    table = markdown(result)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table)
    return 0 if all(math.isfinite(p["kernel_ms"]) for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
