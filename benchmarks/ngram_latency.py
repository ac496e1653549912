"""Proposal latency of the retrieval proposer on the memory and Redis n-gram stores.

    python benchmarks/ngram_latency.py --prompts ../shared/data/stdlib_functions.jsonl \
        --tokenizer ../shared/models/stdlib-code/target [--redis redis://127.0.0.1:6379/0] \
        [--json benchmarks/results/ngram_latency.json]

The stores are warmed like a fleet store after one pass: every prompt + reference of the set
is added (``NGramStore.add``, the learner's path); a Redis store given with --redis keeps what
it held (e.g. an ingested corpus), so lookups run against a store of realistic size. Then, for every prompt, the
proposer drafts (budget --max-nodes x --max-depth) at each position of the reference, the
context growing token by token as in decoding; each ``propose`` (lookup of every suffix
length in one round trip + tree building) is timed. Without --redis a redis-server is
started on a free loopback port (the Debian package), and stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from drafter_service.ngram_store import MemoryNGramStore, RedisNGramStore, StoreConfig, tokenizer_fingerprint
from drafter_service.proposer import DraftSessionState
from drafter_service.retrieval import RetrievalProposer
from specmesh.contract import Budget
from specmesh.models import load_tokenizer
from specmesh.sampling import SamplingParams
from specmesh_app.local_mesh import LocalRedis


def measure(store, sequences: list[tuple[list[int], list[int]]], budget: Budget) -> dict:
    prop = RetrievalProposer(store, None)
    times, nodes = [], []
    for prompt, reference in sequences:
        state = DraftSessionState("s", list(prompt), SamplingParams())
        prop.prepare(state)
        for tok in reference:
            t0 = time.perf_counter()
            tree = prop.propose(state, budget)
            times.append(time.perf_counter() - t0)
            nodes.append(tree.num_nodes)
            state.tokens.append(tok)
    ms = np.asarray(times) * 1e3
    return {"proposals": len(times), "p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
            "nonempty_fraction": float(np.mean(np.asarray(nodes) > 0))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True, type=Path, help="JSONL with prompt and reference")
    p.add_argument("--tokenizer", required=True, type=Path, help="model directory with the tokenizer")
    p.add_argument("--redis", default=None, help="Redis URL (default: start a redis-server on a free port)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-nodes", type=int, default=16)
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    sequences = [(tokenizer(r["prompt"]).input_ids, tokenizer(r["reference"], add_special_tokens=False).input_ids)
                 for r in rows]
    namespace = tokenizer_fingerprint(tokenizer.get_vocab())
    budget = Budget(args.max_nodes, args.max_depth)
    server = None
    url = args.redis
    if url is None:
        try:
            server = LocalRedis()
        except RuntimeError as exc:
            raise SystemExit(f"{exc}; or pass --redis URL") from None
        url = server.url
    try:
        memory = MemoryNGramStore(StoreConfig(), namespace)
        remote = RedisNGramStore.from_url(url, StoreConfig(), namespace, timeout_s=5.0)
        for prompt, reference in sequences:
            memory.add(prompt + reference)
            remote.add(prompt + reference)
        report = {"prompts": str(args.prompts), "num_prompts": len(rows), "budget": [args.max_nodes, args.max_depth],
                  "contexts_stored": len(memory), "memory": measure(memory, sequences, budget),
                  "redis": measure(remote, sequences, budget)}
    finally:
        if server is not None:
            server.stop()
    for name in ("memory", "redis"):
        m = report[name]
        print(f"{name:6s}: {m['proposals']} proposals, p50 {m['p50_ms']:.3f} ms, p90 {m['p90_ms']:.3f} ms, "
              f"p99 {m['p99_ms']:.3f} ms, non-empty {m['nonempty_fraction']:.0%}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
