"""Host cost of a CPU proposer's drafting, per speculative step and per member, without a model.

On a GPU the forward of a verification step is a CUDA-graph replay of a fraction of a millisecond, so a copy
proposer's host work is no longer hidden behind it: on an H100 (``benchmarks/results/gpu_h100_3.md``) ``fused``
drafted in 0.49-0.61 ms a step against a 0.62 ms plain step. This script measures that work alone, the same way on
any machine: each prompt's greedy output (from a ``specmesh bench --methods ar --json`` report, which records the
token ids) is replayed as the target's decisions. Every step the drafter gets the tokens committed since its last
call (and, for proposers that learn from them, the target's top-k after every verified row: the output's next
token first, then fixed pseudo-random ids), drafts a tree within the proposer's default budget, and the tree's
longest path along the output is accepted, plus one token (the target's own). Each ``LocalDrafter.propose`` is
timed (context edit, feedback, drafting), and for ``fused`` each member's ``propose`` and ``observe`` and the
merge.

    specmesh bench --prompts ../shared/data/stdlib_functions.jsonl --target ../shared/models/stdlib-code/target \\
        --limit 16 --max-new-tokens 128 --methods ar --json /tmp/ar.json
    python benchmarks/draft_cost.py --ar /tmp/ar.json --target ../shared/models/stdlib-code/target \\
        --proposers fused prompt_lookup_tree copy suffix:max_spec_factor=2 [--json OUT.json]

A report of ``bench --chat`` is replayed with the prompts through the target's chat template, as it ran them.

The numbers are µs per step (mean and p90 over every step of every prompt), the process's CPU time per step (every
thread: an n-gram store's learner adds the committed tokens on a thread of its own, and on a GPU host that work
holds the interpreter lock too; the replay's own bookkeeping, a few µs a step, is in it), τ (tokens per step) and
nodes per tree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from drafter_service.drafter import LocalDrafter  # noqa: E402
from drafter_service.fusion import FusedProposer  # noqa: E402
from drafter_service.proposer import make_proposer, proposer_names  # noqa: E402
from specmesh.contract import Budget  # noqa: E402
from specmesh.feedback import DraftFeedback, VerifyFeedback  # noqa: E402
from specmesh.models import load_tokenizer  # noqa: E402
from specmesh.sampling import SamplingParams  # noqa: E402
from specmesh.tree import TokenTree  # noqa: E402


def accepted_path(tree: TokenTree, truth: list[int]) -> int:
    """How many of ``truth``'s tokens the tree's best path spells from the root (greedy acceptance)."""
    node, depth = -1, 0
    while depth < len(truth):
        node = next((c for c in tree.children_of(node) if int(tree.tokens[c]) == truth[depth]), None)
        if node is None:
            break
        depth += 1
    return depth


class Timed:
    """Wraps ``obj.method`` to add its wall time to ``totals[label]``."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals

    def wrap(self, obj, method: str, label: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - started

        setattr(obj, method, timed)


def replay(name: str, prompts: list[list[int]], outputs: list[list[int]], topk_rng_seed: int = 0) -> dict:
    """Replay every (prompt, output) through a fresh drafter of proposer ``name`` (a bench method spec:
    ``NAME`` or ``NAME:key=value,...``, budgets and proposer options); timings in µs per step."""
    from specmesh_app.bench import parse_method

    spec = parse_method(name, proposer_names())
    options = dict(spec.options)
    nodes, depth = options.pop("max_nodes"), options.pop("max_depth")
    for key in ("overlap", "policy", "restart_depth"):
        if options.pop(key, None) is not None:
            raise ValueError(f"{name}: {key} is the engine's, not the drafter's: a replay has no engine")
    proposer = make_proposer(spec.name, **options)
    parts: dict[str, float] = defaultdict(float)
    timer = Timed(parts)
    if isinstance(proposer, FusedProposer):
        for member in proposer.members:
            timer.wrap(member, "propose", f"{member.name}.propose")
            timer.wrap(member, "observe", f"{member.name}.observe")
        timer.wrap(proposer, "_calibrate", "calibrate")
    drafter = LocalDrafter(proposer)
    k = proposer.feedback_topk
    rng = np.random.default_rng(topk_rng_seed)
    step_us: list[float] = []
    tokens = trees = tree_nodes = 0
    cpu_started = time.process_time()
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        sid = f"p{i}"
        context = [*prompt, output[0]]  # the prefill's token
        drafter.open(sid, context, SamplingParams(max_new_tokens=len(output)))
        done, new, feedback = 1, [], None
        while done < len(output):
            started = time.perf_counter()
            tree = drafter.propose(sid, new, Budget(nodes, depth), 0, feedback)
            step_us.append((time.perf_counter() - started) * 1e6)
            truth = output[done:]
            accepted = accepted_path(tree, truth)
            new = truth[: accepted + 1]
            trees += 1
            tree_nodes += tree.num_nodes
            tokens += len(new)
            verified = ()
            if k:
                rows = 1 + tree.num_nodes
                topk = rng.integers(0, 1 << 15, size=(rows, k), dtype=np.int64)
                topk[0, 0] = truth[0]
                inputs = np.concatenate([[context[-1]], tree.tokens]).astype(np.int64)
                verified = (VerifyFeedback(inputs, topk),)
            context.extend(new)
            done += len(new)
            feedback = DraftFeedback(len(context), verified)
        drafter.close(sid)
    for part in (proposer, *getattr(proposer, "members", ())):  # what n-gram learners still have to add costs too
        if (learner := getattr(part, "learner", None)) is not None:
            learner.flush()
    cpu_s = time.process_time() - cpu_started
    steps = len(step_us)
    out = {
        "proposer": name, "budget": [nodes, depth], "steps": steps, "tau": tokens / steps,
        "nodes_per_tree": tree_nodes / trees, "us_per_step": float(np.mean(step_us)),
        "us_p90": float(np.percentile(step_us, 90)),
        "cpu_us_per_step": cpu_s * 1e6 / steps,
    }
    if parts:
        out["parts_us_per_step"] = {label: seconds * 1e6 / steps for label, seconds in sorted(parts.items())}
        out["parts_us_per_step"]["merge and rest"] = out["us_per_step"] - sum(parts.values()) * 1e6 / steps
    return out


def recorded_ar(report_path: Path, target: str, prompts_path: str | None = None
                ) -> tuple[list[list[int]], list[list[int]], Path]:
    """(prompt ids, greedy output ids, the prompt file) of the ``ar`` records of a `specmesh bench --json` report,
    the prompts encoded by ``target``'s tokenizer from ``prompts_path`` (default: the report's). ValueError when the
    report has no such records or a prompt encodes to another length than the report's."""
    report = json.loads(report_path.read_text())
    records = [r for r in report.get("records", ()) if r.get("method") == "ar"]
    if not records or "token_ids" not in records[0]:
        raise ValueError(f"{report_path} holds no `ar` records with token ids")
    prompt_file = Path(prompts_path or report["config"]["prompts"])
    by_id = {p["id"]: p for p in map(json.loads, prompt_file.read_text().splitlines()) if p}
    tokenizer = load_tokenizer(target)
    if report["config"].get("chat"):  # the report's run sent them through the chat template (bench --chat)
        from specmesh.chat import ChatTemplate
        from specmesh_app.bench import chat_messages

        template = ChatTemplate.load(target)
        texts = [template.render(chat_messages(by_id[r["prompt_id"]]), add_generation_prompt=True) for r in records]
    else:
        texts = [by_id[r["prompt_id"]]["prompt"] for r in records]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    for r, p in zip(records, prompts, strict=True):
        if len(p) != r["prompt_tokens"]:
            raise ValueError(f"{r['prompt_id']}: {len(p)} prompt tokens here, {r['prompt_tokens']} in the report")
    return prompts, [list(r["token_ids"]) for r in records], prompt_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ar", required=True, help="a `specmesh bench --methods ar --json` report (its records' token ids)")
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer encodes the prompts)")
    ap.add_argument("--prompts", help="the bench's prompt file (default: the report's)")
    ap.add_argument("--proposers", nargs="+", default=["fused", "prompt_lookup_tree"])
    ap.add_argument("--repeats", type=int, default=3, help="replays per proposer; the fastest counts")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    try:
        prompts, outputs, prompt_file = recorded_ar(Path(args.ar), args.target, args.prompts)
    except ValueError as exc:
        ap.error(str(exc))
    results = []
    for name in args.proposers:
        runs = [replay(name, prompts, outputs) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["us_per_step"])
        results.append(best)
        parts = ", ".join(f"{k} {v:.0f}" for k, v in best.get("parts_us_per_step", {}).items())
        print(f"{name}: {best['us_per_step']:.0f} µs/step (p90 {best['us_p90']:.0f}; process CPU "
              f"{best['cpu_us_per_step']:.0f}), τ {best['tau']:.2f}, "
              f"{best['nodes_per_tree']:.1f} nodes/tree" + (f" [{parts}]" if parts else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"ar": args.ar, "prompts": str(prompt_file), "results": results},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
