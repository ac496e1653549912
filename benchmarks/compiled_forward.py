"""A forward's time eager vs ``torch.compile``d on this machine (issue 32 item 3), with a real model's weights.

What is compiled is the runner's layer stack: per layer, the dense part before attention (RMSNorm, fused QKV,
rotary) and after it (output projection, residual, RMSNorm, gated MLP), each one ``torch.compile(dynamic=True)``
function that every layer calls with its own weights (so one compilation serves the stack), plus the final norm
and LM head; attention between them stays as the runner runs it (SDPA over a KV of ``--context`` positions, the
same eager call in both columns). Rows: 1 (plain decoding), 17 (a 16-node tree) and 64. Both columns use the
``FastLlamaRunner``'s own fused weights, in float32 and bfloat16; the first compiled call's time is reported apart.

    python benchmarks/compiled_forward.py /work/shared/models/stdlib-code/target
    python benchmarks/compiled_forward.py ~/.cache/specmesh-bench/smollm2-135m-instruct/hf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specmesh import models


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _pre(x, ln1, qkv_w, qkv_b, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    h = _rms(x, ln1, eps)
    qkv = torch.addmm(qkv_b, h, qkv_w) if qkv_b is not None else h @ qkv_w
    t, q_size, kv_size = x.shape[0], heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(t, heads, head_dim).transpose(0, 1)
    k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim).transpose(0, 1)
    v = qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim).transpose(0, 1)
    half = head_dim // 2

    def rope(z):
        return z * cos + torch.cat((-z[..., half:], z[..., :half]), dim=-1) * sin

    return rope(q), rope(k), v


def _post(x, attn, o_w, o_b, ln2, gate_up, down, eps: float):
    x = x + (torch.addmm(o_b, attn, o_w) if o_b is not None else attn @ o_w)
    gate, up = (_rms(x, ln2, eps) @ gate_up).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ down


def _head(x, norm, lm_head, eps: float):
    return (_rms(x, norm, eps) @ lm_head).float()


def forward_ms(runner, rows: int, context: int, fns, repeats: int) -> float:
    pre, post, head = fns
    dtype = runner.dtype
    gen = torch.Generator().manual_seed(0)
    hidden = runner.lm_head.shape[0]
    x0 = torch.randn(rows, hidden, generator=gen).to(dtype)
    cos, sin = runner.cos[context : context + rows], runner.sin[context : context + rows]
    keys = [torch.randn(runner.num_kv_heads, context, runner.head_dim, generator=gen).to(dtype) for _ in runner.layers]
    mask = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)

    def once():
        x = x0
        for (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down), past in zip(runner.layers, keys, strict=True):
            q, k, v = pre(x, ln1, qkv_w, qkv_b, cos, sin, runner.eps, runner.num_heads, runner.num_kv_heads,
                          runner.head_dim)
            k, v = torch.cat([past, k], dim=1), torch.cat([past, v], dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = post(x, a.transpose(0, 1).reshape(rows, -1), o_w, o_b, ln2, gate_up, down, runner.eps)
        return head(x, runner.norm, runner.lm_head, runner.eps)

    once()
    started = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - started) / max(repeats, 1) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="a local Llama-family checkpoint")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 17, 64])
    parser.add_argument("--context", type=int, default=256, help="cached positions attended (default: 256)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for dtype_name in args.dtypes:
        runner = models.load_runner(args.model_dir, getattr(torch, dtype_name), "fast", "cpu")
        eager = (_pre, _post, _head)
        compiled = tuple(torch.compile(f, dynamic=True) for f in eager)
        for rows in args.rows:
            started = time.perf_counter()
            forward_ms(runner, rows, args.context, compiled, 0)
            first = time.perf_counter() - started
            e = forward_ms(runner, rows, args.context, eager, args.repeats)
            c = forward_ms(runner, rows, args.context, compiled, args.repeats)
            results.append({"dtype": dtype_name, "rows": rows, "eager_ms": round(e, 2), "compiled_ms": round(c, 2),
                            "speedup": round(e / c, 3), "first_compiled_call_s": round(first, 1)})
            print(f"{dtype_name} rows={rows}: eager {e:.2f} ms, compiled {c:.2f} ms ({e / c:.2f}x); "
                  f"first compiled call {first:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model_dir), "context": args.context,
                                         "threads": args.threads, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
