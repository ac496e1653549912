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
(temperature 0.7, top-p 0.95: acceptance by rejection sampling). The 16-node tree is 4 branches of 4 under the root.

The model directory is the one ``benchmarks/engine_overhead.py`` builds (1 layer, 128 wide, random weights).
"""

from __future__ import annotations

import argparse
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


def median_step_ms(runner, sessions: int, nodes: int, steps: int, prefix_caching: bool, options: str = "none",
                   shape: str = "chain") -> float:
    verifier = LocalVerifier(runner, max_tree_nodes=64, prefix_caching=prefix_caching)
    sampling = SamplingParams(max_new_tokens=1000, ignore_eos=True, **OPTIONS[options])
    ids = [f"s{i}" for i in range(sessions)]
    for i, sid in enumerate(ids):
        verifier.admit(sid, [5 + (i + j) % 97 for j in range(32)], sampling)
    while prefilling := [sid for sid in ids if verifier.prefilling(sid)]:
        verifier.step(prefilling, [])
    tree = TokenTree.chain(list(range(7, 7 + nodes))) if nodes else TokenTree.empty()
    if shape == "tree":  # 4 branches of 4 tokens under the root
        tree = TokenTree(np.arange(7, 7 + nodes), np.array([-1 if i % 4 == 0 else i - 1 for i in range(nodes)]),
                         np.ones(nodes))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        verifier.step([], [(sid, tree) for sid in ids])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL,
                        help=f"the tiny model (default: {DEFAULT_MODEL}; engine_overhead.py builds it)")
    parser.add_argument("--steps", type=int, default=150, help="steps timed per case (default: 150)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--options", choices=sorted(OPTIONS), default="none",
                        help="request options every session asks (default: none)")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        raise SystemExit(f"no model in {args.model_dir}: run benchmarks/engine_overhead.py once to build it")
    torch.set_num_threads(1)
    runner = models.load_runner(args.model_dir, torch.float32, "fast", "cpu")
    for label, sessions, nodes, shape in (
            ("plain, 1 session", 1, 0, "chain"), ("plain, 16", 16, 0, "chain"), ("plain, 64", 64, 0, "chain"),
            ("16-node chain, 1", 1, 16, "chain"), ("16-node chain, 16", 16, 16, "chain"),
            ("16-node tree, 1", 1, 16, "tree"), ("16-node tree, 16", 16, 16, "tree")):
        best = min(median_step_ms(runner, sessions, nodes, args.steps, args.prefix_caching, args.options, shape)
                   for _ in range(3))
        print(f"{label}: {best:.3f} ms")


if __name__ == "__main__":
    main()
