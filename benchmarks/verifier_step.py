"""The host cost of one batched verifier step: ``LocalVerifier.step`` alone, on a model whose forward costs ~nothing.

Admits N sessions (32-token prompts), prefills them, then times ``--steps`` steps of plain decoding (an empty tree
each) or of a 16-node chain each, for N in 1, 16, 64; prints the median step time, best of 3 runs. Use it to
compare the step's host work between two checkouts (run it from each, one after the other):

    python benchmarks/verifier_step.py                     # ~/.cache/specmesh-bench/tiny-llama-1x128
    python benchmarks/verifier_step.py --no-prefix-caching
    python benchmarks/verifier_step.py --options penalties   # the request options' host cost (issue 36)
    python benchmarks/verifier_step.py --options sampled     # rejection sampling's (issue 32)

``--options``: what every session asks beside greedy decoding: ``penalties`` (presence 0.5, frequency 0.5,
repetition 1.1, a logit_bias of 4 tokens), ``logprobs`` (5 alternatives), ``all`` (both), ``sampled``
(temperature 0.7, top-p 0.95: acceptance by rejection sampling). The 16-node tree is 4 branches of 4 under the root,
the 64-node one 8 branches of 8.

The model directory is the one ``benchmarks/engine_overhead.py`` builds (1 layer, 128 wide, random weights). With
another model, a device and a dtype, the same step measures what a tree costs end to end against one token (issue
32's goal on a GPU: 64 nodes at batch 1 in at most 1.1x a plain step), each tree case's ratio to the plain case of
its batch beside it:

    python benchmarks/verifier_step.py --model-dir DIR --device cuda --dtype bfloat16 --prompt-tokens 512 \\
        --cases plain1 tree16x1 tree64x1 plain8 tree64x8 --steps 50 --json tree_cost.json

On CUDA the runner's defaults apply (the tree-attention kernel, ``torch.compile``, CUDA graphs); a step's time ends
with its one host copy, so it is the device's time as the host sees it. Buckets met first in a timed run are
captured there: the best of 3 runs leaves them out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specmesh import models
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

DEFAULT_MODEL = Path.home() / ".cache" / "specmesh-bench" / "tiny-llama-1x128"


OPTIONS = {
    "none": {},
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                      logit_bias=((3, 1.0), (4, -1.0), (5, 2.0), (6, -2.0))),
    "logprobs": dict(logprobs=5),
    "sampled": dict(temperature=0.7, top_p=0.95),
}
OPTIONS["all"] = {**OPTIONS["penalties"], **OPTIONS["logprobs"]}


# name: (label, sessions, tree nodes, shape); the default set is the first seven
CASES = {
    "plain1": ("plain, 1 session", 1, 0, "chain"), "plain16": ("plain, 16", 16, 0, "chain"),
    "plain64": ("plain, 64", 64, 0, "chain"), "chain16x1": ("16-node chain, 1", 1, 16, "chain"),
    "chain16x16": ("16-node chain, 16", 16, 16, "chain"), "tree16x1": ("16-node tree, 1", 1, 16, "tree"),
    "tree16x16": ("16-node tree, 16", 16, 16, "tree"), "plain8": ("plain, 8", 8, 0, "chain"),
    "tree64x1": ("64-node tree, 1", 1, 64, "tree"), "tree64x8": ("64-node tree, 8", 8, 64, "tree"),
}
DEFAULT_CASES = ("plain1", "plain16", "plain64", "chain16x1", "chain16x16", "tree16x1", "tree16x16")


def tree_of(nodes: int, shape: str) -> TokenTree:
    """No tree, a chain of ``nodes``, or branches under the root (4 nodes deep up to 16 nodes, 8 above)."""
    if nodes == 0:
        return TokenTree.empty()
    if shape == "chain":
        return TokenTree.chain(list(range(7, 7 + nodes)))
    depth = 4 if nodes <= 16 else 8
    return TokenTree(np.arange(7, 7 + nodes), np.array([-1 if i % depth == 0 else i - 1 for i in range(nodes)]),
                     np.ones(nodes))


def median_step_ms(verifier: LocalVerifier, sessions: int, nodes: int, steps: int, options: str = "none",
                   shape: str = "chain", prompt_tokens: int = 32) -> float:
    """Admit and prefill ``sessions`` sessions, time ``steps`` steps of each verifying the tree, release them."""
    sampling = SamplingParams(max_new_tokens=1000, ignore_eos=True, **OPTIONS[options])
    ids = [f"s{i}" for i in range(sessions)]
    for i, sid in enumerate(ids):
        verifier.admit(sid, [5 + (i + j) % 97 for j in range(prompt_tokens)], sampling)
    while prefilling := [sid for sid in ids if verifier.prefilling(sid)]:
        verifier.step(prefilling, [])
    tree = tree_of(nodes, shape)
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            verifier.step([], [(sid, tree) for sid in ids])
            times.append(time.perf_counter() - started)
    finally:
        for sid in ids:
            verifier.release(sid)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL,
                        help=f"the model (default: {DEFAULT_MODEL}; engine_overhead.py builds it)")
    parser.add_argument("--steps", type=int, default=150, help="steps timed per case (default: 150)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--options", choices=sorted(OPTIONS), default="none",
                        help="request options every session asks (default: none)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(DEFAULT_CASES),
                        help="what to time (default: %(default)s): plainN = N sessions decoding, chainKxN / treeKxN "
                             "= N sessions each verifying a K-node chain / tree")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="each session's prompt (default: 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        raise SystemExit(f"no model in {args.model_dir}: run benchmarks/engine_overhead.py once to build it")
    if args.steps < 1 or args.prompt_tokens < 1:
        raise SystemExit("--steps and --prompt-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    runner = models.load_runner(args.model_dir, getattr(torch, args.dtype), "fast", args.device)
    # one verifier (one KV pool, on CUDA one set of graphs) for every case: a bucket captured in a first run is
    # replayed in the next ones
    verifier = LocalVerifier(runner, max_tree_nodes=64, prefix_caching=args.prefix_caching)
    results, plain = [], {}
    for name in args.cases:
        label, sessions, nodes, shape = CASES[name]
        best = min(median_step_ms(verifier, sessions, nodes, args.steps, args.options, shape, args.prompt_tokens)
                   for _ in range(3))
        if nodes == 0:
            plain[sessions] = best
        ratio = best / plain[sessions] if nodes and sessions in plain else None
        results.append({"case": name, "label": label, "sessions": sessions, "nodes": nodes, "shape": shape,
                        "median_step_ms": best, "x_plain": ratio})
        print(f"{label}: {best:.3f} ms" + (f" ({ratio:.2f}x plain)" if ratio is not None else ""))
    if args.json is not None:
        report = {"model": str(args.model_dir), "device": str(runner.device), "dtype": args.dtype,
                  "prompt_tokens": args.prompt_tokens, "steps": args.steps, "options": args.options,
                  "torch": torch.__version__, "results": results}
        if torch.cuda.is_available() and runner.device.type == "cuda":
            report["gpu"] = torch.cuda.get_device_name(runner.device)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
