"""Python calls per extra request per step: the engine core's host work counted, not timed (issue 67 (a)).

The target is engine_overhead.py's 1-layer, 128-wide Llama with random weights (its forward costs ~nothing), run
by the engine core (orchestrator/core.py ``EngineCore`` over a ``LocalVerifier``) with 1 request and with
--requests requests in flight, two ways: plain decoding (no drafter) and a 16-node tree every step (four chains of
four from engine_overhead.py's proposer that costs nothing; the random model's greedy text repeats, so most of a
chain is accepted: ~3.9 of 4 levels a step). Method, per run:

1. submit every request (greedy, ignore_eos, max_new_tokens far past the counted window: none finishes in it),
   wait until all are decoding (prefills done), then --warmup more steps;
2. through the loop's ``call_soon`` (run on the loop's thread at the top of a round), ``sys.setprofile`` a counter
   on that thread alone; --steps steps later (``BatchStats.steps``) a second ``call_soon`` removes it. The window is
   whole rounds of the loop, each one step; no prefill chunk and no finished request inside it (checked);
3. count profile events whose code lies in the project's packages (PROJECT_DIRS): 'call' (a Python function
   entered, generator resumes included; by file:function) and, separately, 'c_call' (a builtin called from
   project code). A dataclass's generated ``__init__`` counts as its class's module's. The benchmark's own
   callbacks (the outputs, the proposer) and the standard library's and numpy's Python are outside.

Reported: calls per step at 1 and at N requests, and per extra request = (calls/step at N - at 1) / (N - 1),
for plain and tree, with the top functions by calls per extra request (what to vectorise). Counts, not timings:
the machine's load does not change them (only the steps where a KV cache grows differ between windows). Usage:

    python benchmarks/python_calls.py --json benchmarks/results/python_calls.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from benchmarks.engine_overhead import (  # noqa: E402
    DEFAULT_MODEL_DIR,
    DEFAULT_PROMPTS,
    REPO,
    TREE_NODES,
    build_model,
    fixed_tree_proposer,
    load_prompts,
)

PROJECT_DIRS = ("specmesh", "orchestrator", "drafter_service", "verifier_service", "kernels")
LOOP_NAME = "python-calls-core"


class CallCounter:
    """A ``sys.setprofile`` function: the 'call' events of the project's code by file:function, and the 'c_call'
    events (builtins) made from it. A method a decorator generated (a dataclass's ``__init__``, whose file is
    "<string>") is the project's when its class is: building a ``StepStats`` is a call into the project."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.c_calls = 0
        self._names: dict[object, str | None] = {}  # code object -> "file:function", None outside the project
        self._roots = tuple(f"{REPO / d}/" for d in PROJECT_DIRS)

    def _name(self, frame) -> str | None:
        code = frame.f_code
        name = self._names.get(code, False)
        if name is False:
            name = self._generated(frame) if code.co_filename.startswith("<") else \
                self._project(code.co_filename, code.co_qualname)
            self._names[code] = name
        return name

    def _project(self, filename: str, function: str) -> str | None:
        return f"{Path(filename).relative_to(REPO)}:{function}" if filename.startswith(self._roots) else None

    def _generated(self, frame) -> str | None:
        code = frame.f_code
        if not code.co_argcount:
            return None
        first = frame.f_locals.get(code.co_varnames[0])  # self (or cls)
        cls = first if isinstance(first, type) else type(first)
        filename = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
        return self._project(filename, f"{cls.__qualname__}.{code.co_name}")

    def __call__(self, frame, event: str, arg) -> None:
        if event == "call":
            name = self._name(frame)
            if name is not None:
                self.calls[name] += 1
        elif event == "c_call" and self._name(frame) is not None:
            self.c_calls += 1


class _Discard:
    """A RequestOutput that drops what it is sent."""

    def event(self, event) -> None:
        pass

    def finish(self, result, error) -> None:
        pass


def _wait_until(ready, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine core did not get there in time")
        time.sleep(0.0005)


def count_calls(runner, prompts: list[list[int]], tree: bool, steps: int, warmup: int = 3,
                kv_cache_gb: float = 0.25) -> dict:
    """One run (module doc): every prompt a request in flight, plain decoding or (``tree``) a 16-node tree per step;
    the project's Python calls on the loop thread over ``steps`` decode steps. Returns {"steps", "calls" (a
    Counter by file:function), "c_calls"}."""
    from drafter_service.drafter import LocalDrafter
    from orchestrator.core import EngineCore
    from orchestrator.drafter_link import only
    from orchestrator.policy import StaticPolicy
    from orchestrator.requests import Method
    from specmesh.sampling import SamplingParams
    from verifier_service.verifier import LocalVerifier

    method = Method(only(LocalDrafter(fixed_tree_proposer()), "fixed_tree"), StaticPolicy(TREE_NODES, TREE_NODES // 4)) \
        if tree else Method()
    # a tree step commits at most depth + 1 tokens: far more than the window's steps can take
    sampling = SamplingParams(max_new_tokens=(TREE_NODES // 4 + 1) * (warmup + steps) + 256, ignore_eos=True)
    core = EngineCore(LocalVerifier(runner, 256, kv_cache_gb=kv_cache_gb), name=LOOP_NAME)
    counter, window, done = CallCounter(), {}, threading.Event()
    n = len(prompts)

    def snapshot() -> tuple:  # on the loop thread; checked once the run is over
        return core.stats.steps, core.stats.prefill_chunks, core.num_running, core.num_waiting

    def start() -> None:
        window["start"] = snapshot()
        sys.setprofile(counter)

    def stop() -> None:
        sys.setprofile(None)
        window["stop"] = snapshot()
        done.set()

    try:
        ids = [core.submit(p, sampling, method, _Discard()) for p in prompts]
        _wait_until(lambda: core.num_running == n)
        first = core.stats.steps
        _wait_until(lambda: core.stats.steps >= first + warmup)
        core.call_soon(start)
        _wait_until(lambda: "start" in window)
        _wait_until(lambda: core.stats.steps >= window["start"][0] + steps)
        core.call_soon(stop)
        if not done.wait(600):
            raise TimeoutError("the counted window did not close")
        for request_id in ids:
            core.cancel(request_id)
    finally:
        core.close()
    (steps0, chunks0, *busy0), (steps1, chunks1, *busy1) = window["start"], window["stop"]
    assert busy0 == busy1 == [n, 0], "a request finished, or was not decoding, inside the counted window"
    assert chunks1 == chunks0, "a prefill chunk ran inside the counted window"
    return {"steps": steps1 - steps0, "calls": counter.calls, "c_calls": counter.c_calls}


def per_extra_request(one: dict, many: dict, n: int) -> dict:
    """Calls per step at 1 and at ``n`` requests, per extra request, and by function (per extra request)."""
    def extra(at_1: float, at_n: float) -> float:
        return (at_n - at_1) / (n - 1)

    calls = [sum(run["calls"].values()) / run["steps"] for run in (one, many)]
    c_calls = [run["c_calls"] / run["steps"] for run in (one, many)]
    functions = {name: extra(one["calls"][name] / one["steps"], many["calls"][name] / many["steps"])
                 for name in set(one["calls"]) | set(many["calls"])}
    return {"calls_per_step_1": calls[0], f"calls_per_step_{n}": calls[1], "calls_per_extra_request": extra(*calls),
            "c_calls_per_step_1": c_calls[0], f"c_calls_per_step_{n}": c_calls[1],
            "c_calls_per_extra_request": extra(*c_calls), "steps": [one["steps"], many["steps"]],
            "functions": dict(sorted(functions.items(), key=lambda item: (-item[1], item[0])))}


def measure(runner, prompts: list[list[int]], tree: bool, steps: int, warmup: int = 3,
            kv_cache_gb: float = 0.25) -> dict:
    """``per_extra_request`` of a run with the first prompt alone and one with all of them."""
    one = count_calls(runner, prompts[:1], tree, steps, warmup, kv_cache_gb)
    many = count_calls(runner, prompts, tree, steps, warmup, kv_cache_gb)
    return per_extra_request(one, many, len(prompts))


# ------------------------------------------------------------------ the benchmark
def render(report: dict, top: int) -> str:
    n = report["requests"]
    lines = [f"| step | calls/step at 1 | calls/step at {n} | calls/extra request | c_calls/step at 1 "
             f"| c_calls/step at {n} | c_calls/extra request |", "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in report["results"].items():
        lines.append(f"| {kind} | {r['calls_per_step_1']:.1f} | {r[f'calls_per_step_{n}']:.1f} | "
                     f"{r['calls_per_extra_request']:.1f} | {r['c_calls_per_step_1']:.1f} | "
                     f"{r[f'c_calls_per_step_{n}']:.1f} | {r['c_calls_per_extra_request']:.1f} |")
    for kind, r in report["results"].items():
        lines += ["", f"Top {top} functions by calls per extra request, {kind}:", "",
                  "| file:function | calls/extra request |", "|---|---:|"]
        lines += [f"| `{name}` | {value:.2f} |" for name, value in list(r["functions"].items())[:top]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="where the tiny model is built/kept")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field")
    p.add_argument("--prompt-tokens", type=int, default=32, help="the last N tokens of each prompt")
    p.add_argument("--requests", type=int, default=17, help="requests in flight of the loaded run (N)")
    p.add_argument("--steps", type=int, default=100, help="decode steps counted per run")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before the counted ones")
    p.add_argument("--top", type=int, default=15, help="functions listed per step kind")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()

    import torch

    from specmesh.fast_llama import make_runner
    from specmesh.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    model_dir = build_model(args.model_dir)
    runner = make_runner(load_model(model_dir, torch.float32, "cpu"))
    prompts = [p[-args.prompt_tokens:] for p in load_prompts(args.prompts, load_tokenizer(model_dir), args.requests)]
    results = {kind: measure(runner, prompts, kind == "tree", args.steps, args.warmup) for kind in ("plain", "tree")}
    report = {"command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "python": platform.python_version(), "torch": torch.__version__, "model_dir": str(model_dir),
              "requests": args.requests, "steps": args.steps, "warmup": args.warmup, "results": results}
    print(render(report, args.top))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
