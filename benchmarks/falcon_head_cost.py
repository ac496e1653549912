"""What a Falcon head costs beside its target: one drafting pass against one target forward.

For each prompt's context (its first ``--context`` tokens), median of ``--repeats`` timed calls, one thread:

- ``target_1``: the target's forward of one new token after the context (the cache cut back after each call);
- ``target_N``: the same for a tree of N new rows (``--tree-rows``; the verification of an N-node tree);
- ``head_pass``: one drafting pass of the head as the proposer runs it (a static ``1x1`` tree of one block:
  the final-block forward over k rows, one LM-head call, the tree built), state already in sync;
- ``head_lm``: the head's LM-head call alone over its k rows (a reduced head: its N rows of the target's);
- ``full_lm``: the same rows through the target's whole LM head (what a full-vocabulary head pays).

Reported as milliseconds and as fractions of ``target_1``. Usage (from the repository root):

    python benchmarks/falcon_head_cost.py --target ~/.cache/specmesh-bench/smollm2-135m-instruct/hf \\
        --head ~/.cache/specmesh-bench/heads/smollm2-falcon-k2-v8192 --prompts ../shared/data/humaneval.jsonl \\
        --json benchmarks/results/falcon_head_cost_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter_service.drafter import LocalDrafter
from drafter_service.falcon import falcon_proposer
from specmesh import models
from specmesh.contract import Budget
from specmesh.sampling import SamplingParams


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def measure(runner, tokenizer, head_dir: Path, prompts: list[str], context: int, tree_rows: int,
            repeats: int) -> dict:
    proposer = falcon_proposer(target_runner=runner, head=str(head_dir), tree="static", shape="1x1")
    head = proposer.head
    k = head.config.k
    drafter = LocalDrafter(proposer)
    rows = {"target_1": [], f"target_{tree_rows}": [], "head_pass": [], "head_lm": [], "full_lm": []}
    full = head.tables.lm_head
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text)[:context]
        n = len(ids)
        cache = runner.new_cache()
        runner.forward_batch([cache], ids, list(range(n)), [n], [None])

        def target(rows_new: int, cache=cache, n=n, last=ids[-1]) -> None:
            runner.forward_batch([cache], [last] * rows_new, list(range(n, n + rows_new)), [rows_new], [None])
            cache.truncate(n)

        rows["target_1"].append(median_ms(lambda: target(1), repeats))
        rows[f"target_{tree_rows}"].append(median_ms(lambda: target(tree_rows), repeats))
        session = f"s{i}"
        drafter.open(session, ids, SamplingParams(temperature=0.0, max_new_tokens=16))
        rows["head_pass"].append(median_ms(lambda s=session: drafter.propose(s, [], Budget(k, k)), repeats))
        drafter.close(session)
        out = torch.randn(k, head.config.hidden_size, dtype=full.dtype)
        rows["head_lm"].append(median_ms(lambda o=out: head.logits(o), repeats))
        rows["full_lm"].append(median_ms(lambda o=out: F.linear(o, full).float(), repeats))
    ms = {name: statistics.median(values) for name, values in rows.items()}
    base = ms["target_1"]
    return {"head": str(head_dir), "k": k, "draft_vocab": head.config.draft_vocab or head.config.vocab_size,
            "vocab": head.config.vocab_size, "head_parameters": head.num_parameters(), "ms": ms,
            "of_target_1": {name: value / base for name, value in ms.items()},
            "training": json.loads((head_dir / "config.json").read_text()).get("training", {}).get("after")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target model directory")
    p.add_argument("--head", type=Path, nargs="+", required=True, help="Falcon head directories")
    p.add_argument("--prompts", type=Path, default=Path("../shared/data/humaneval.jsonl"))
    p.add_argument("--limit", type=int, default=4, help="prompts measured (default: 4)")
    p.add_argument("--context", type=int, default=256, help="context tokens per prompt, at most (default: 256)")
    p.add_argument("--tree-rows", type=int, default=16, help="rows of the tree forward timed (default: 16)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measure and prompt (default: 20)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    runner = models.load_runner(args.target, dtype, "auto", "cpu", "sdpa")
    tokenizer = models.load_tokenizer(args.target)
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit]
    results = [measure(runner, tokenizer, head, prompts, args.context, args.tree_rows, args.repeats)
               for head in args.head]
    print(f"target {args.target} ({args.dtype}, {args.threads} thread(s)), {len(prompts)} prompts, "
          f"context <= {args.context} tokens; ms, median over prompts of the median of {args.repeats} calls")
    names = list(results[0]["ms"])
    print("| head | k | draft vocab | " + " | ".join(names) + " | head_pass / target_1 |")
    print("|---|---|---|" + "---:|" * (len(names) + 1))
    for r in results:
        print(f"| {Path(r['head']).name} | {r['k']} | {r['draft_vocab']} | "
              + " | ".join(f"{r['ms'][n]:.2f}" for n in names) + f" | {r['of_target_1']['head_pass']:.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
