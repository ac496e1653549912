"""Device-to-host reads per verifier step and per batched draft step (issue 32 items 1-2), on the CPU.

There is no device here, so ``specmesh.host_reads`` marks what the forward returns and counts every host read of
it and of what is computed from it (``.cpu()``, ``.tolist()``, ``.item()``, ``bool()``, ``nonzero``, boolean
masks...): on an accelerator each is a wait for the device. The accelerator's code paths are taken (the CPU-only
shortcuts, which read the host for free there, are turned off). Prints, per case, the median reads per step over
``--steps`` steps of 8 sessions on the tiny model ``benchmarks/engine_overhead.py`` builds. Run it from two
checkouts to compare (copy ``specmesh/host_reads.py`` into an older one):

    python benchmarks/host_transfers.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch

from drafter_service import draft_model
from drafter_service.draft_model import DraftModelProposer
from drafter_service.proposer import DraftSessionState
from specmesh import models, warp
from specmesh.contract import Budget
from specmesh.host_reads import counting, mark_outputs
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from verifier_service.verifier import LocalVerifier

DEFAULT_MODEL = Path.home() / ".cache" / "specmesh-bench" / "tiny-llama-1x128"
GREEDY = SamplingParams(max_new_tokens=1000, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=1000, ignore_eos=True, temperature=0.7, top_p=0.95)
TREES = {
    "plain": TokenTree.empty(),
    "4-token chain": TokenTree.chain([7, 8, 9, 10]),
    "8-node tree": TokenTree(np.arange(7, 15), np.array([-1, 0, 1, -1, 3, 0, -1, 6]), np.ones(8)),
}


def verifier_reads(runner, sampling: SamplingParams, tree: TokenTree, steps: int, feedback: bool) -> int:
    verifier = LocalVerifier(runner, feedback_topk=4 if feedback else 0)
    ids = [f"s{i}" for i in range(8)]
    for i, sid in enumerate(ids):
        verifier.admit(sid, [5 + (i + j) % 97 for j in range(16)], sampling)
    while prefilling := [sid for sid in ids if verifier.prefilling(sid)]:
        verifier.step(prefilling, [])
    counts = []
    for _ in range(steps):
        with counting() as reads:
            verifier.step([], [(sid, tree) for sid in ids])
        counts.append(len(reads))
    return int(statistics.median(counts))


def draft_reads(runner, sampling: SamplingParams, steps: int) -> int:
    proposer = DraftModelProposer(runner)
    states = [DraftSessionState(f"s{i}", [5 + (i + j) % 97 for j in range(16)], sampling) for i in range(8)]
    counts = []
    for _ in range(steps):
        with counting() as reads:
            trees = proposer.propose_batch(states, [Budget(4, 4)] * len(states))
        counts.append(len(reads))
        for state, tree in zip(states, trees, strict=True):
            state.tokens += tree.tokens[:1].tolist() + [11]
    return int(statistics.median(counts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL,
                        help=f"the tiny model (default: {DEFAULT_MODEL}; engine_overhead.py builds it)")
    parser.add_argument("--steps", type=int, default=10, help="steps per case (default: 10)")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        raise SystemExit(f"no model in {args.model_dir}: run benchmarks/engine_overhead.py once to build it")
    warp.CPU_SHORTCUT = False  # the accelerator's paths (attributes an older checkout ignores)
    draft_model.CPU_STOPS_EARLY = False
    runner = mark_outputs(models.load_runner(args.model_dir, torch.float32, "fast", "cpu"))
    print("| verifier step, 8 sessions | greedy | greedy + top-k feedback | sampled (T=0.7, top-p 0.95) |")
    print("|---|---|---|---|")
    for name, tree in TREES.items():
        cells = [verifier_reads(runner, GREEDY, tree, args.steps, False),
                 verifier_reads(runner, GREEDY, tree, args.steps, True),
                 verifier_reads(runner, SAMPLED, tree, args.steps, False)]
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |")
    print(f"| draft model, 4-token chains | {draft_reads(runner, GREEDY, args.steps)} | – | "
          f"{draft_reads(runner, SAMPLED, args.steps)} |")


if __name__ == "__main__":
    main()
