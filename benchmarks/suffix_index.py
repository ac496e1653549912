"""Costs of the suffix proposer's index (drafter_service/suffix_index.py), without a model.

A global index is filled with ``--tokens`` tokens of real, mostly distinct code (the Python sources of the
installed ``transformers`` package, tokenized by the target's tokenizer, one sequence per file, cut to 512-token
outputs) and the script reports its memory (bytes and nodes per token held) and the update cost (µs per token
added). Then ``--sessions`` sessions, each over one prompt of ``--prompts`` (its own index: the prompt), run a
replayed decode: each step one token is committed and the proposer's step runs (``suffix_index.propose``: the
token into the session's index, a tree from each index, the better kept), round-robin over the sessions as an
engine step calls them; it reports µs per request per step (mean and p90), and the per-request index's update
cost when a prompt is indexed.

    python benchmarks/suffix_index.py --target ../shared/models/stdlib-code/target \\
        --prompts benchmarks/data/editing.jsonl [--tokens 1000000] [--sessions 64] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from drafter_service.suffix_index import SuffixIndex, out_buffers, propose  # noqa: E402
from specmesh.models import load_tokenizer  # noqa: E402

OUTPUT_TOKENS = 512  # the length of one "output" added to the global index


def corpus(tokenizer, num_tokens: int) -> list[list[int]]:
    """Outputs of OUTPUT_TOKENS tokens from the transformers package's sources, ``num_tokens`` in all."""
    import transformers

    out, total = [], 0
    for path in sorted(Path(transformers.__file__).parent.rglob("*.py")):
        ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        for lo in range(0, len(ids), OUTPUT_TOKENS):
            piece = ids[lo : lo + OUTPUT_TOKENS]
            out.append(piece)
            total += len(piece)
            if total >= num_tokens:
                return out
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a model directory (its tokenizer)")
    ap.add_argument("--prompts", required=True, help="JSONL prompts (id, prompt): the sessions' contexts")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens in the global index (default 1M)")
    ap.add_argument("--sessions", type=int, default=64, help="sessions drafting in turn (default 64)")
    ap.add_argument("--steps", type=int, default=200, help="steps per session (default 200)")
    ap.add_argument("--depth", type=int, default=24, help="the tries' depth (default 24)")
    ap.add_argument("--budget", default="32,24", help="nodes,depth of each tree (default 32,24)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.target)
    max_nodes, max_depth = map(int, args.budget.split(","))
    outputs = corpus(tokenizer, args.tokens)
    index = SuffixIndex(args.depth, args.tokens)
    started = time.perf_counter()
    for seq in outputs:
        index.add(seq)
    add_s = time.perf_counter() - started
    added = sum(map(len, outputs))
    result = {
        "global_tokens": index.num_tokens, "global_nodes": index.num_nodes,
        "nodes_per_token": index.num_nodes / index.num_tokens, "bytes_per_token": index.nbytes / index.num_tokens,
        "add_us_per_token": add_s * 1e6 / added,
    }
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    sessions, started, prompt_tokens = [], time.perf_counter(), 0
    for i in range(args.sessions):
        prompt = prompts[i % len(prompts)]
        cut = len(prompt) // 2  # the second half is "generated", one token a step
        local = SuffixIndex(args.depth, None, max(256, len(prompt)))
        local.extend(prompt[:cut])
        prompt_tokens += cut
        sessions.append((local, prompt, cut, out_buffers(max_nodes)))
    prefill_us = (time.perf_counter() - started) * 1e6 / prompt_tokens
    step_us, nodes = [], []
    for step in range(args.steps):
        for local, prompt, cut, buffers in sessions:
            end = cut + step + 1
            if end > len(prompt):
                continue
            tokens = prompt[max(0, end - 1 - args.depth) : end]  # the context's tail; its last token is new
            t0 = time.perf_counter()
            spec = propose(local, index, tokens, len(tokens) - 1, len(tokens), max_nodes, max_depth, 0.1, 2.0, 8.0,
                           buffers)
            step_us.append((time.perf_counter() - t0) * 1e6)
            nodes.append(spec.tokens.size)
    result.update({
        "sessions": args.sessions, "steps": len(step_us), "prompt_index_us_per_token": prefill_us,
        "step_us_mean": float(np.mean(step_us)), "step_us_p90": float(np.percentile(step_us, 90)),
        "nodes_per_tree": float(np.mean(nodes)),
    })
    result["mb_per_million_tokens"] = result["bytes_per_token"]  # bytes per token == MB per million tokens
    print(f"global index: {result['global_tokens']:,} tokens, {result['global_nodes']:,} nodes "
          f"({result['nodes_per_token']:.2f} per token), {result['bytes_per_token']:.0f} bytes per token "
          f"({result['mb_per_million_tokens']:.0f} MB per million tokens); adding: "
          f"{result['add_us_per_token']:.2f} µs per token")
    print(f"{args.sessions} sessions: a request's step {result['step_us_mean']:.1f} µs (p90 "
          f"{result['step_us_p90']:.1f}), {result['nodes_per_tree']:.1f} nodes per tree; a prompt indexed at "
          f"{prefill_us:.2f} µs per token")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
