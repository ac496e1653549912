"""The forward on a CPU at the row counts of decode and verify steps: per weight layout, dtype and compile mode.

A verify step sends a few rows (a tree's nodes, a batch's pending tokens) through every matrix of the target,
and on a real vocabulary (SmolLM2: 49,152 x 576) the output layer is the largest of them. On a CPU the speed
of ``x [rows, in] @ W`` for a few rows depends on how W is stored, differently per dtype; this script measures
what the fast runner chooses (``specmesh.cpu_platform.in_out_layout`` and ``head_blocks``) against the
alternatives, one thread, median of ``--repeats`` calls:

- ``products``: the model's output layer alone, per dtype: ``in_out`` (x @ a contiguous [hidden, vocab]),
  ``out_in`` (F.linear on [vocab, hidden]), ``blocked`` (``blocked_product`` over ``head_blocks``);
- ``forward``: a whole forward of ``rows`` new tokens after a ``--context``-token prompt, in milliseconds:
  float32 with and without the blocked output layer, and with the layer stack compiled frozen
  (``--compile frozen``, in each of ``--frozen-dtypes``: its compile time is reported); bfloat16 with the weights
  as the runner keeps them now (views of [out, in]) and as contiguous [in, out] copies (how it kept them before).
  ``--only-frozen`` times just eager against frozen in ``--frozen-dtypes`` (no products, no other layouts).

Usage (from the repository root; SmolLM2 made by ``../shared/tools/smollm2.sh``):

    python benchmarks/cpu_forward.py --target ~/.cache/specmesh-bench/smollm2-135m-instruct/hf \\
        --json benchmarks/results/cpu_forward_smollm2.json
    python benchmarks/cpu_forward.py --target ~/.cache/specmesh-bench/smollm2-135m-instruct/hf \
        --only-frozen --frozen-dtypes bfloat16 --json benchmarks/results/cpu_forward_smollm2_bf16_frozen_dispatch.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from benchmarks.falcon_head_cost import median_ms  # noqa: E402
from specmesh.cpu_platform import blocked_product, head_blocks  # noqa: E402
from specmesh.fast_llama import FastLlamaRunner  # noqa: E402

ROWS = (1, 2, 3, 4, 8, 16, 32)
FORWARD_ROWS = (1, 2, 4, 8, 16, 24)
SLOW_BF16_ROWS = 2  # x @ a contiguous [in, out] bf16 matrix takes ~0.25 s per row of a 49k vocabulary here


@torch.inference_mode()
def products(lm_head: torch.Tensor, dtype: torch.dtype, repeats: int) -> dict[str, dict[int, float]]:
    """lm_head [vocab, hidden] -> {layout: {rows: ms}}."""
    w = lm_head.to(dtype).contiguous()  # [vocab, hidden]
    w_t = w.t().contiguous()  # [hidden, vocab]
    blocks = head_blocks(w_t)
    vocab, hidden = w.shape
    table: dict[str, dict[int, float]] = {"in_out": {}, "out_in": {}, "blocked": {}}
    gen = torch.Generator().manual_seed(0)
    for rows in ROWS:
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        if dtype == torch.float32 or rows <= SLOW_BF16_ROWS:
            table["in_out"][rows] = median_ms(lambda x=x: x @ w_t, repeats)
        table["out_in"][rows] = median_ms(lambda x=x: F.linear(x, w), repeats)
        if blocks is not None and (dtype == torch.float32 or rows <= SLOW_BF16_ROWS):
            table["blocked"][rows] = median_ms(lambda x=x: blocked_product(x, blocks, vocab), repeats)
    return table


@torch.inference_mode()
def forward_ms(runner: FastLlamaRunner, context: int, repeats: int, rows_list=FORWARD_ROWS) -> dict[int, float]:
    """{rows: ms} of one forward of ``rows`` new tokens (causal) after a ``context``-token prompt."""
    cache = runner.new_cache()
    prompt = list(range(100, 100 + context))
    runner.forward_batch([cache], prompt, list(range(context)), [context], [None], logit_rows=slice(context - 1, None))
    out = {}
    for rows in rows_list:
        def once(rows=rows) -> None:
            runner.forward_batch([cache], [7] * rows, list(range(context, context + rows)), [rows], [None])
            cache.truncate(context)
        out[rows] = median_ms(once, repeats)
    return out


def _contiguous_layers(runner: FastLlamaRunner) -> None:
    """The weights as contiguous [in, out] copies (the layout the runner kept in every dtype before)."""
    runner.layers = [tuple(w if w is None or w.dim() < 2 else w.contiguous() for w in layer) for layer in runner.layers]
    runner.lm_head = runner.lm_head.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a local HF Llama-family checkpoint directory")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed forward")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per cell (the median is reported)")
    ap.add_argument("--skip-frozen", action="store_true", help="leave out the frozen stack (it compiles for minutes)")
    ap.add_argument("--frozen-dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                    help="dtypes whose frozen stack is timed (default: float32)")
    ap.add_argument("--only-frozen", action="store_true",
                    help="time only eager and frozen forwards in --frozen-dtypes (default layouts)")
    ap.add_argument("--rows", type=int, nargs="+", default=list(FORWARD_ROWS),
                    help="new rows per timed forward with --only-frozen (plain decoding of a batch: one per request)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = Path(args.target).expanduser()
    results: dict = {"target": str(path), "context": args.context, "threads": 1, "cpu": torch.backends.cpu.get_cpu_capability()}
    if args.only_frozen:
        results["forward_ms"] = frozen_against_eager(path, args.frozen_dtypes, args.context, args.repeats, results,
                                                     tuple(args.rows))
    else:
        results["forward_ms"] = every_layout(path, args, results)
    print(json.dumps(results["forward_ms"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def frozen_against_eager(path: Path, dtypes: list[str], context: int, repeats: int, results: dict,
                         rows=FORWARD_ROWS) -> dict:
    """{label: {rows: ms}}: each dtype's forward eager, then with its stack frozen (compile seconds in results)."""
    forward = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        forward[f"{name} eager"] = forward_ms(FastLlamaRunner.from_checkpoint(path, dtype), context, repeats, rows)
        forward[f"{name} frozen stack"], results[f"frozen_compile_s_{name}"] = frozen_ms(path, name, context, repeats,
                                                                                          rows)
    return forward


def frozen_ms(path: Path, name: str, context: int, repeats: int, rows=FORWARD_ROWS) -> tuple[dict[int, float], float]:
    """({rows: ms}, seconds to load and compile) of the model's stack frozen in dtype ``name``."""
    started = time.perf_counter()
    frozen = FastLlamaRunner.from_checkpoint(path, getattr(torch, name), compile_layers="frozen")
    seconds = round(time.perf_counter() - started, 1)
    return forward_ms(frozen, context, repeats, rows), seconds


def every_layout(path: Path, args, results: dict) -> dict:
    """{label: {rows: ms}}: the layouts and modes of the module doc (output-layer products go into results)."""
    fp32 = FastLlamaRunner.from_checkpoint(path, torch.float32)
    lm_head = fp32.lm_head.t()  # [vocab, hidden]
    results["vocab"], results["hidden"] = int(lm_head.shape[0]), int(lm_head.shape[1])
    results["products"] = {str(d).removeprefix("torch."): products(lm_head, d, args.repeats)
                           for d in (torch.float32, torch.bfloat16)}
    print(json.dumps(results["products"], indent=1), flush=True)
    forward = {"float32 blocked head": forward_ms(fp32, args.context, args.repeats)}
    fp32.head_blocks = None
    forward["float32 whole head"] = forward_ms(fp32, args.context, args.repeats)
    del fp32
    for name in [] if args.skip_frozen else args.frozen_dtypes:
        label = "float32 blocked head" if name == "float32" else f"{name} [out, in] views"
        key = "frozen_compile_s" if name == "float32" else f"frozen_compile_s_{name}"
        forward[f"{label}, frozen stack"], results[key] = frozen_ms(path, name, args.context, args.repeats)
    bf16 = FastLlamaRunner.from_checkpoint(path, torch.bfloat16)
    forward["bfloat16 [out, in] views"] = forward_ms(bf16, args.context, args.repeats)
    _contiguous_layers(bf16)
    forward["bfloat16 contiguous [in, out]"] = forward_ms(bf16, args.context, max(1, args.repeats // 3), (1, 4))
    return forward


if __name__ == "__main__":
    main()
