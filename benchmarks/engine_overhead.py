"""The engine's own cost: host time per step and tokens/s under load, with a target whose forward costs ~nothing.

The target is a 1-layer, 128-wide Llama with random weights (built by this script, saved as a Hugging Face
directory so peers such as `benchmarks/vllm_peer.py --model DIR` load the same model), so what a step costs is
the engine's host work: scheduling, drafting calls, packing, acceptance, compaction, streaming. Two engines run
the same requests in one process, one after the other:

- ``core``: the engine core (orchestrator/core.py): one thread steps every request; requests are submitted
  and consumed through callbacks (a finished request submits the next prompt), no thread per request;
- ``threads``: the per-request engine (orchestrator/engine.py) on a StepLoop, one client thread per
  request in flight (the embedded path before the engine core).

(a) host time per step: plain decoding and a 16-node tree every step (four chains of four, from a proposer that
costs nothing), each with 1, 16 and 64 requests in flight, on short prompts (the last --host-prompt-tokens
of each: attention over a long context is the model's work, not the engine's); ms per step = wall time of
the level / verifier steps (prefill steps included; every request is prompt + 128 tokens), µs per extra
request = (ms/step at 64 - ms/step at 1) / 63. Each step is split into the model's arithmetic (the forward's wall
time less the forward's own index and mask building: what a device would run; ``ForwardClock``) and the
engine's host time (the rest), reported as "host ms/step" and "host µs/extra".
(b) tokens/s at 1, 16 and 64 requests in flight, closed loop over the prompts, for ``ar`` and
``prompt_lookup_tree``.

Greedy, ignore_eos: every request generates exactly --max-new-tokens tokens, and the outputs of both engines
are checked equal. One torch thread (--threads). Usage:

    python benchmarks/engine_overhead.py --prompts ../shared/data/stdlib_functions.jsonl \\
        --json benchmarks/results/engine_overhead_final.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "../shared"
DEFAULT_MODEL_DIR = Path.home() / ".cache/specmesh-bench/tiny-llama-1x128"
DEFAULT_PROMPTS = SHARED / "data/stdlib_functions.jsonl"
TREE_NODES = 16


def build_model(directory: Path) -> Path:
    """The 1-layer, 128-wide Llama (seeded random weights) with the bundled demo tokenizer (4,096 tokens: the
    output layer stays cheap too); kept if it already exists."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    tokenizer_dir = REPO / "specmesh/demo_models/target"
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    directory.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def load_prompts(path: Path, tokenizer, limit: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if len(rows) < limit:  # say so: two runs on different prompts are not comparable
        print(f"engine_overhead: {path} has {len(rows)} of the {limit} prompts asked for; the rest are synthetic "
              "(give --prompts)", file=sys.stderr)
    prompts = [tokenizer.encode(r["prompt"]) for r in rows[:limit]]
    while len(prompts) < limit:  # synthetic prompts when the shared set is absent or short
        n = len(prompts)
        prompts.append([(7 * n + 13 * i) % 1000 + 10 for i in range(100 + n % 50)])
    return prompts


def fixed_tree_proposer():
    """A proposer that costs nothing: four chains of four nodes, from the context's last tokens (mostly
    rejected by a random model: the step's host cost, not its acceptance, is measured)."""
    import numpy as np

    from drafter_service.proposer import Proposer
    from specmesh.tree import TokenTree

    class FixedTree(Proposer):
        name = "fixed_tree"

        def propose(self, state, budget):
            chains, depth = 4, min(TREE_NODES // 4, budget.max_depth)  # shallower only at a request's last steps
            tail = state.tokens[-4:] * 4
            tokens = np.array([tail[(c + d) % len(tail)] for c in range(chains) for d in range(depth)], np.int64)
            parents = np.array([-1 if d == 0 else c * depth + d - 1 for c in range(chains) for d in range(depth)],
                               np.int64)
            return TokenTree(tokens, parents, np.ones(len(tokens), np.float32), ("fixed",) * len(tokens))

    return FixedTree()


class ForwardClock:
    """Wall time spent in the target's forward, less the forward's own host work (building the attention's
    indices and masks): ``model_s`` is what a device would run, the rest of a step is the engine's host time.
    On the CPU the forward is synchronous, so its wall time is its cost; on a GPU (launches are asynchronous)
    the split is only meaningful with ``torch.cuda.synchronize`` per step, which this does not add."""

    def __init__(self, runner) -> None:
        from specmesh.kernel_attention import KernelAttention
        from specmesh.sdpa_attention import SdpaAttention

        self.model_s = 0.0
        forward = runner.forward_batch

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.model_s += time.perf_counter() - start

        runner.forward_batch = timed_forward
        for cls in (SdpaAttention, KernelAttention):  # their constructors: host work
            init = cls.__init__

            def timed_init(obj, *args, _init=init, **kwargs):
                start = time.perf_counter()
                try:
                    return _init(obj, *args, **kwargs)
                finally:
                    self.model_s -= time.perf_counter() - start

            cls.__init__ = timed_init


# ------------------------------------------------------------------ drivers
def run_core(core, method, prompts, concurrency: int, sampling, clock: ForwardClock | None = None) -> dict:
    """Closed loop on the engine core through callbacks (``bench --concurrency``'s driver): ``concurrency``
    requests in flight, a finished request submits the next prompt (on the core thread). No client threads."""
    from orchestrator.embedded import CoreEngine
    from specmesh_app.bench_load import run_level_on_core

    steps, model_s = core.stats.steps, clock.model_s if clock else 0.0
    level = [(str(i), prompt, sampling.max_new_tokens) for i, prompt in enumerate(prompts)]
    records, wall = run_level_on_core(CoreEngine(core, method), None, level, sampling, concurrency)
    return {"wall_s": wall, "steps": core.stats.steps - steps, "outputs": {r["index"]: r["tokens"] for r in records},
            "model_s": clock.model_s - model_s if clock else None}


def run_threads(engine, verifier, prompts, concurrency: int, sampling, clock: ForwardClock | None = None) -> dict:
    """Closed loop on the per-request engine: one client thread per request in flight."""
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    outputs: dict[int, list[int]] = {}

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index, prompt = queue.pop(0)
            outputs[index] = engine.generate(prompt, sampling).token_ids

    steps, model_s = verifier.stats.steps, clock.model_s if clock else 0.0
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.perf_counter() - start, "steps": verifier.stats.steps - steps, "outputs": outputs,
            "model_s": clock.model_s - model_s if clock else None}


# ------------------------------------------------------------------ the benchmark
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="where the tiny model is built/kept")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts per level of (b)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--host-prompt-tokens", type=int, default=32,
                   help="(a) keeps the last N tokens of each prompt, so attention over a long context does not hide "
                        "the host work; (b) uses whole prompts, as the vLLM peer does")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="requests in flight")
    p.add_argument("--engines", nargs="+", choices=["core", "threads"], default=["threads", "core"])
    p.add_argument("--parts", nargs="+", choices=["a", "b"], default=["a", "b"], help="which parts to run")
    p.add_argument("--methods", nargs="+", choices=["ar", "prompt_lookup_tree"], default=["ar", "prompt_lookup_tree"],
                   help="(b)'s methods")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", type=Path, default=None, help="write the report here (and the table beside it, .md)")
    args = p.parse_args()

    import torch

    sys.path.insert(0, str(REPO))
    from drafter_service.drafter import LocalDrafter
    from drafter_service.proposer import make_proposer
    from orchestrator.drafter_link import only
    from orchestrator.engine import Engine
    from orchestrator.policy import StaticPolicy, resolve_budget
    from specmesh.fast_llama import make_runner
    from specmesh.host_runtime import freeze_heap, tune_host_allocator
    from specmesh.models import load_model, load_tokenizer
    from specmesh.sampling import SamplingParams
    from verifier_service.step_loop import StepLoop
    from verifier_service.verifier import LocalVerifier

    torch.set_num_threads(args.threads)
    tune_host_allocator()  # as the specmesh command does
    model_dir = build_model(args.model_dir)
    runner = make_runner(load_model(model_dir, torch.float32, "cpu"))
    clock = ForwardClock(runner)
    freeze_heap()  # as the specmesh commands do once their models are loaded
    prompts = load_prompts(args.prompts, load_tokenizer(model_dir), max(args.num_prompts, max(args.levels)))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    kv_gb = 1.0

    def method_parts(name: str):
        if name == "ar":
            return None, StaticPolicy(0, 0)
        if name == "fixed_tree":
            return LocalDrafter(fixed_tree_proposer()), StaticPolicy(TREE_NODES, TREE_NODES // 4)
        nodes, depth = resolve_budget(name, None, None, 256)
        return LocalDrafter(make_proposer(name)), StaticPolicy(nodes, depth)

    def run(engine_kind: str, name: str, level_prompts, concurrency: int) -> dict:
        """A fresh verifier (and drafter) per run: no state carries over between levels."""
        drafter, policy = method_parts(name)
        local = LocalVerifier(runner, 256, kv_cache_gb=kv_gb)
        if engine_kind == "core":
            # absent before the engine core: run --engines threads there
            from orchestrator.core import EngineCore
            from orchestrator.requests import Method

            core = EngineCore(local)
            try:
                run_core(core, Method(only(drafter, name), policy), level_prompts[:2], 2,
                         SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
                return run_core(core, Method(only(drafter, name), policy), level_prompts, concurrency, sampling,
                                clock)
            finally:
                core.close()
        verifier = StepLoop(local)
        try:
            engine = Engine(verifier, only(drafter, name), policy, overlap=False)
            run_threads(engine, verifier, level_prompts[:2], 2, SamplingParams(max_new_tokens=8, ignore_eos=True))
            return run_threads(engine, verifier, level_prompts, concurrency, sampling, clock)
        finally:
            verifier.close()

    rows, reference = [], {}
    short = [p[-args.host_prompt_tokens:] for p in prompts]
    plan = []
    if "a" in args.parts:
        plan += [("a", name, n, short[:n]) for name in ("ar", "fixed_tree") for n in args.levels]
    if "b" in args.parts:
        plan += [("b", name, n, prompts[: args.num_prompts]) for name in args.methods
                 for n in args.levels]
    for part, name, n, level_prompts in plan:
        for kind in args.engines:
            out = run(kind, name, level_prompts, n)
            tokens = sum(len(t) for t in out["outputs"].values())
            key = (part, n)
            if name in ("ar", "prompt_lookup_tree"):
                reference.setdefault(key, out["outputs"])
            match = sum(reference[key].get(i) == t for i, t in out["outputs"].items()) / len(out["outputs"]) \
                if name in ("ar", "prompt_lookup_tree") else None
            row = {"part": part, "engine": kind, "method": name, "concurrency": n, "requests": len(level_prompts),
                   "tokens": tokens, "wall_s": out["wall_s"], "steps": out["steps"],
                   "ms_per_step": out["wall_s"] / out["steps"] * 1e3, "tokens_per_s": tokens / out["wall_s"],
                   "model_ms_per_step": out["model_s"] / out["steps"] * 1e3,
                   "host_ms_per_step": (out["wall_s"] - out["model_s"]) / out["steps"] * 1e3,
                   "greedy_match_ar": match}
            rows.append(row)
            print(f"({part}) {kind:7s} {name:18s} x{n:<3d} {row['ms_per_step']:7.3f} ms/step "
                  f"(host {row['host_ms_per_step']:6.3f}) {row['tokens_per_s']:8.0f} tok/s  steps {out['steps']}",
                  file=sys.stderr)
    for kind, name in ((kind, name) for kind in args.engines for name in ("ar", "fixed_tree")):
        level = {r["concurrency"]: r for r in rows if r["part"] == "a" and r["engine"] == kind and r["method"] == name}
        lo, hi = min(level, default=0), max(level, default=0)
        if hi > lo:
            per_extra = {key: (level[hi][key] - level[lo][key]) / (hi - lo) * 1e3
                         for key in ("ms_per_step", "model_ms_per_step", "host_ms_per_step")}
            rows.append({"part": "a", "engine": kind, "method": name, "concurrency": f"per extra request ({lo}->{hi})",
                         "us_per_extra_request": per_extra["ms_per_step"],
                         "model_us_per_extra_request": per_extra["model_ms_per_step"],
                         "host_us_per_extra_request": per_extra["host_ms_per_step"]})
    report = {"command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
              "model_dir": str(model_dir), "max_new_tokens": args.max_new_tokens, "rows": rows}
    table = render(report)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        args.json.with_suffix(".md").write_text(f"`{report['command']}` ({report['date']}, torch {report['torch']}, "
                                                f"{args.threads} thread)\n\n{table}\n")
    return 0


def render(report: dict) -> str:
    lines = ["| part | engine | method | requests in flight | ms/step | host ms/step | model ms/step | µs/extra request "
             "| host µs/extra | tokens/s | greedy = ref |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def fmt(r: dict, key: str, digits: int) -> str:
        return "–" if r.get(key) is None else f"{r[key]:.{digits}f}"

    for r in report["rows"]:
        lines.append(f"| ({r['part']}) | {r['engine']} | {r['method']} | {r['concurrency']} | {fmt(r, 'ms_per_step', 3)} | "
                     f"{fmt(r, 'host_ms_per_step', 3)} | {fmt(r, 'model_ms_per_step', 3)} | "
                     f"{fmt(r, 'us_per_extra_request', 0)} | {fmt(r, 'host_us_per_extra_request', 0)} | "
                     f"{fmt(r, 'tokens_per_s', 0)} | {fmt(r, 'greedy_match_ar', 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
