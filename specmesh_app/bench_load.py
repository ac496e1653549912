"""`specmesh bench --concurrency N [N ...]`: throughput and latency with N requests in flight.

For each method and each N: a closed loop, each request streaming its prompt to the end
and the next prompt taken when one ends, so exactly N requests are in flight until the
prompts run out. Embedded methods run on the stack's engine core (one thread steps every
request, one forward per step for all), driven by callbacks: the tokens of a step are
stamped as the core commits them, and a finished request submits the next prompt, with no
client threads; ``grpc:NAME`` methods go through the client SDK to `specmesh serve`, one
client thread per request in flight. Hugging Face methods do not batch across requests and are skipped.

Per method and N: aggregate generated tokens/s (all tokens / wall time from the first
request to the last), per-token latency p50/p99 (the gaps between streamed tokens,
pooled over all requests; a step that commits k tokens counts k gaps of a k-th of its
time, as vLLM's inter-token latency does), time to first token p50, τ (tokens per
verification step), tree nodes verified per step (what the speculation policy chose), the
verifier's mean batch (Verify calls per forward, embedded only) and, over the decode steps (prefill-only
forwards left out), Verify calls and requests decoding per step and the share of the decoding requests each step
verified (1: none sat a step out; with as many prompts as N the batch still shrinks at the end, as requests of
different τ finish at different steps: more prompts than N keep it full; the same figures while the prompts last,
``steady_*``, count only the steps before the last prompt was submitted, N in flight), and the speed against ``ar``
at the same N and against the method itself at the lowest N.
Greedy outputs are checked against the ``ar`` output of the same prompt at N = 1. Every
level starts from a fresh drafter (in this process; a remote drafter keeps what it
learned), since the same prompts run at every level. Before each level a warm-up, untimed, runs
its first N prompts at N in flight for ``WARMUP_TOKENS`` tokens each: the first forwards of a batch
shape allocate and page in, and on a GPU capture the CUDA graphs of their buckets (what the
measured level still captures is in ``graph_captures`` / ``graph_capture_s``): a level measures a
server that has been running, not its first steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from drafter_service.draft_kv import draft_kv
from specmesh.sampling import SamplingParams
from specmesh_app.bench_runners import MethodSpec, asked_sampling

PROFILE_ROWS = 30  # operators per table of --profile
WARMUP_TOKENS = 16  # new tokens per request of the warm-up before each level

# yields (tokens in the chunk, tree nodes verified in its step, or None for the prefill's chunk)
Streamer = Callable[[list[int], SamplingParams], Iterator[tuple[list[int], int | None]]]


def embedded_engine(stack, spec: MethodSpec):
    """The method's engine on the stack's engine core (a CoreEngine: every request of the level on one core), with
    a fresh proposer (a level's: it learns nothing from the warm-up or the levels before; serve keeps one)."""
    options = {k: v for k, v in spec.options if k != "threshold"}  # the verifier's (mjsd), not the proposer's
    return stack.engine(None if spec.name == "ar" else spec.name, fresh=True, **options)


def run_level_on_core(engine, spec: MethodSpec | None, prompts: Sequence[tuple[str, list[int], int]],
                      base: SamplingParams, concurrency: int, progress=None,
                      drained: Callable[[], None] | None = None) -> tuple[list[dict], float]:
    """``run_level`` for an engine core (``engine``: a CoreEngine) without client threads: requests are submitted
    with callbacks that stamp each step's tokens as the core commits them, and a finished request submits the next
    prompt (on the core thread), so exactly ``concurrency`` are in flight. ``spec``: the method whose sampling
    options apply (None: ``base`` as it is); ``drained``: called (on the core thread) once the last prompt is
    submitted in the place of one that finished (from then on fewer than ``concurrency`` are in flight as requests
    finish); never with no more prompts than ``concurrency``."""
    queue = list(enumerate(prompts))
    lock, done = threading.Lock(), threading.Event()
    records: list[dict] = []
    errors: list[BaseException] = []

    class Output:  # orchestrator.core.RequestOutput
        def __init__(self, index: int, pid: str) -> None:
            self.index, self.pid, self.start = index, pid, time.perf_counter()
            self.tokens, self.stamps, self.steps, self.nodes, self.drafting = [], [], 0, 0, 0.0

        def event(self, event) -> None:
            self.stamps.append((time.perf_counter(), len(event.tokens)))
            self.tokens += event.tokens
            if event.step is not None:
                self.steps, self.nodes = self.steps + 1, self.nodes + event.step.num_proposed
                self.drafting += event.step.drafter_busy_seconds

        def finish(self, result, error) -> None:
            stamps = self.stamps
            gaps = [(t - prev) / k for (prev, _), (t, k) in zip(stamps, stamps[1:], strict=False) if k
                    for _ in range(k)]
            with lock:
                if error is not None:
                    errors.append(error)
                records.append({"id": self.pid, "index": self.index, "tokens": self.tokens, "steps": self.steps,
                                "nodes": self.nodes, "drafting_s": self.drafting, "gaps": gaps,
                                "ttft": stamps[0][0] - self.start if stamps else None, "start": self.start,
                                "end": stamps[-1][0] if stamps else self.start})
            if progress is not None:
                progress.update(1)
            submit_next()

    def submit_next(refill: bool = True) -> None:
        with lock:
            if not queue or errors:
                if len(records) == len(prompts) or errors:
                    done.set()
                return
            index, (pid, ids, max_new) = queue.pop(0)
            last = not queue
        seed = None if base.seed is None else base.seed + index
        sampling = dataclasses.replace(base, max_new_tokens=max_new, seed=seed)
        sampling = sampling if spec is None else asked_sampling(spec, sampling)
        try:
            engine.core.submit(ids, sampling, engine.method, Output(index, pid))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            with lock:
                errors.append(exc)
            done.set()
            return
        if last and refill and drained is not None:  # (none when the first ones are all: nothing was refilled)
            drained()

    start = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        submit_next(refill=False)
    done.wait()
    if errors:
        raise errors[0]
    return sorted(records, key=lambda r: r["index"]), time.perf_counter() - start


def grpc_streamer(client, spec: MethodSpec) -> tuple[Streamer, None]:
    from specmesh_app.bench_runners import GrpcRunner

    params = GrpcRunner(client, spec).params

    def stream(prompt: list[int], sampling: SamplingParams):
        for chunk in client.stream(prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                   top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                                   ignore_eos=sampling.ignore_eos, **params):
            yield list(chunk.token_ids), None if chunk.step is None else chunk.step.num_proposed

    return stream, None


def run_level(stream: Streamer, prompts: Sequence[tuple[str, list[int], int]], base: SamplingParams,
              concurrency: int, progress=None) -> tuple[list[dict], float]:
    """Every prompt once with ``concurrency`` requests in flight; (records, wall seconds)."""

    def one(index: int, prompt: tuple[str, list[int], int]) -> dict:
        pid, ids, max_new = prompt
        seed = None if base.seed is None else base.seed + index
        sampling = dataclasses.replace(base, max_new_tokens=max_new, seed=seed)
        start = time.perf_counter()
        tokens, stamps, steps, nodes = [], [], 0, 0
        for chunk, step_nodes in stream(ids, sampling):
            stamps.append((time.perf_counter(), len(chunk)))
            tokens += chunk
            if step_nodes is not None:
                steps, nodes = steps + 1, nodes + step_nodes
        gaps = [(t - prev) / k for (prev, _), (t, k) in zip(stamps, stamps[1:], strict=False) if k
                for _ in range(k)]
        return {"id": pid, "tokens": tokens, "steps": steps, "nodes": nodes, "gaps": gaps,
                "ttft": stamps[0][0] - start if stamps else None, "start": start,
                "end": stamps[-1][0] if stamps else start}

    return closed_loop(prompts, one, concurrency, "bench-client", progress)


def closed_loop(items: Sequence, run: Callable[[int, object], dict], concurrency: int, name: str,
                progress=None) -> tuple[list[dict], float]:
    """``run(index, item)`` for every item on ``concurrency`` threads, each taking the next item when its last one
    returned (N in flight until the items run out); (their records, each with its ``index``, in item order; wall
    seconds from the first start to the last answer). The first error stops the loop and is raised once every
    thread has stopped."""
    queue = list(enumerate(items))
    lock = threading.Lock()
    records: list[dict] = []
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                index, item = queue.pop(0)
            try:
                record = run(index, item)
            except BaseException as exc:  # noqa: BLE001 (raised after the other threads stop)
                with lock:
                    errors.append(exc)
                return
            with lock:
                records.append({"index": index, **record})
                if progress is not None:
                    progress.update(1)

    threads = [threading.Thread(target=worker, name=f"{name}-{i}") for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sorted(records, key=lambda r: r["index"]), wall


def summarize(records: list[dict], wall: float) -> dict:
    tokens = sum(len(r["tokens"]) for r in records)
    gaps = np.array([g for r in records for g in r["gaps"]]) * 1e3
    ttft = np.array([r["ttft"] for r in records if r["ttft"] is not None]) * 1e3
    steps = sum(r["steps"] for r in records)
    # τ: tokens per verification step (the first token of each request comes from the prefill)
    tau = (tokens - len(records)) / steps if steps else None
    return {
        "requests": len(records), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
        "itl_p50_ms": float(np.percentile(gaps, 50)) if gaps.size else None,
        "itl_p99_ms": float(np.percentile(gaps, 99)) if gaps.size else None,
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft.size else None, "tau": tau,
        "nodes_per_step": sum(r["nodes"] for r in records) / steps if steps else None,  # tree size sent
        # the drafter's busy time per step of a request (the tree it waited for or took ready, and what it drafted
        # ahead during the verification); through gRPC only the steps' counts are known
        **({"draft_ms_per_step": 1e3 * sum(r["drafting_s"] for r in records) / steps if steps else None}
           if all("drafting_s" in r for r in records) else {}),
    }


def core_counters(core, runners: dict[str, object]) -> dict[str, float]:
    """The running totals ``core_figures`` takes differences of: the verifier loop's steps, Verify calls and step
    seconds, the prefix cache's hit tokens, and the graph counters of each of ``runners`` (prefix -> the target's
    or the draft model's runner, or None) that replays CUDA graphs."""
    stats = core.stats
    counters = {"steps": stats.steps, "verified": stats.verified, "step_seconds": stats.step_seconds.sum,
                "hits": core.verifier.allocator.hits, "decode_steps": stats.decode_steps, "decoding": stats.decoding,
                "stepped_share": stats.stepped_share}
    if hasattr(core.verifier, "copy_seconds"):  # in process: a step's parts before and in its one host copy
        counters.update(queue_seconds=core.verifier.queue_seconds, copy_seconds=core.verifier.copy_seconds)
    for prefix, runner in runners.items():
        graph_stats = getattr(runner, "graph_stats", None)
        if graph_stats is not None and getattr(runner, "cuda_graphs", "off") != "off":
            counters.update({f"{prefix}_{k}": v for k, v in graph_stats().items()})
    return counters


def core_figures(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """A level's figures from the counters before and after it: ``verifier_steps`` (batched forwards, prefill
    chunks' included), ``mean_batch`` (Verify calls per forward), and over the ``decode_steps`` (the forwards with a
    request decoding: not the prefill-only ones) ``decode_mean_batch`` (Verify calls per decode step),
    ``mean_running`` (requests decoding per decode step, in the step or not: below N where requests are
    prefilling or, once the prompts run out, have finished) and ``stepped_per_running`` (the mean per decode step
    of the share of the decoding requests it verified: 1 when none sat a step out; what ``mean_batch`` below N
    owes to the engine rather than to the load's shape),
    ``prefix_cache_hit_tokens`` (the prompts repeat across levels and methods: later ones find them cached),
    ``verifier_step_ms`` (a step's forward, acceptance and host copy, mean), of which (in process)
    ``verifier_queue_ms`` (its host work until the one copy: packing, the forward's launches or on the CPU the
    forward itself, the decisions) and ``verifier_copy_ms`` (its wait in that copy: on a GPU the device's work
    left once the host had queued it all; the rest of the step is the acceptance's host part and the results),
    ``host_ms_per_step`` (the rest of
    the wall time per step: drafting, packing, commit, streaming, and any wait between steps), and with CUDA
    graphs ``graph_replays``, ``graph_eager`` (steps that fit no bucket), ``graph_captures`` and
    ``graph_capture_s`` (buckets captured during the level, each a warm-up run and a capture, in its wall time)."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    steps = delta["steps"]
    figures = {"verifier_steps": steps, "mean_batch": delta["verified"] / steps if steps else None,
               **decode_figures(before, after), "prefix_cache_hit_tokens": delta["hits"],
               "verifier_step_ms": 1e3 * delta["step_seconds"] / steps if steps else None,
               "host_ms_per_step": 1e3 * (wall - delta["step_seconds"]) / steps if steps else None}
    if "copy_seconds" in delta and steps:
        figures.update(verifier_queue_ms=1e3 * delta["queue_seconds"] / steps,
                       verifier_copy_ms=1e3 * delta["copy_seconds"] / steps)
    for prefix in ("graph", "draft_graph"):  # the target's, the draft model's
        if f"{prefix}_replays" in delta:
            figures.update({f"{prefix}_replays": delta[f"{prefix}_replays"], f"{prefix}_eager": delta[f"{prefix}_eager"],
                            f"{prefix}_captures": delta[f"{prefix}_captures"],
                            f"{prefix}_capture_s": delta[f"{prefix}_capture_seconds"]})
    return figures


def decode_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Between two ``core_counters``: the ``decode_steps`` (forwards with a request decoding), and over them
    ``decode_mean_batch``, ``mean_running`` and ``stepped_per_running`` (see ``core_figures``)."""
    steps = after["decode_steps"] - before.get("decode_steps", 0)
    verified, decoding = after["verified"] - before.get("verified", 0), after["decoding"] - before.get("decoding", 0)
    share = after["stepped_share"] - before.get("stepped_share", 0)
    return {"decode_steps": steps, "decode_mean_batch": verified / steps if steps else None,
            "mean_running": decoding / steps if steps else None,
            "stepped_per_running": share / steps if steps else None}


@contextlib.contextmanager
def profiled(directory: Path | None, name: str):
    """With a directory: run the block under torch.profiler (every thread's operators, and the CUDA kernels on
    a GPU) and write ``DIR/NAME.txt``: the operators by self CPU time, then (on a GPU) by CUDA time. Timings
    taken under the profiler are inflated; it says where a step's time goes, not how fast it is."""
    if directory is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    try:  # the engine core steps on its own thread, the drafters on theirs: record them all (torch >= 2.7)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
    except TypeError as exc:
        raise SystemExit(f"specmesh bench --profile: this torch ({torch.__version__}) cannot profile every "
                         f"thread: {exc}") from exc
    with profile(activities=activities, experimental_config=config) as prof:
        yield
    averages = prof.key_averages()
    tables = [f"# {name}: operators by self CPU time\n",
              averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)]
    if cuda:
        tables += [f"\n# {name}: operators by CUDA time\n", averages.table(sort_by="cuda_time_total", row_limit=PROFILE_ROWS)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.txt").write_text("".join(tables))


def run_load_bench(args, specs: Sequence[MethodSpec], stack, prompts, base: SamplingParams, client) -> dict:
    """The load report: per method, per concurrency, the summary (see module doc)."""
    from tqdm import tqdm

    levels = sorted(set(args.concurrency))
    methods = [s for s in specs if not s.is_hf]
    skipped = [s.label for s in specs if s.is_hf]
    rows: list[dict] = []
    reference: dict[int, list[int]] = {}
    for spec in methods:
        def level(n: int, level_prompts, sampling: SamplingParams, bar=None, spec=spec):
            """One level from a fresh drafter (learning proposers start from scratch: the prompts repeat);
            (records, wall seconds, the in-process verifier's figures: ``core_figures``, {} through gRPC)."""
            if spec.is_grpc:
                return (*run_level(grpc_streamer(client, spec)[0], level_prompts, sampling, n, bar), {})
            engine = embedded_engine(stack, spec)
            runners = {"graph": stack.target_runner, "draft_graph": getattr(stack, "draft_runner", None)}
            before, drained = core_counters(engine.core, runners), {}
            records, wall = run_level_on_core(engine, spec, level_prompts, sampling, n, bar,
                                              lambda: drained.update(core_counters(engine.core, runners)))
            figures = core_figures(before, core_counters(engine.core, runners), wall)
            # while the prompts lasted (N in flight, some of them prefilling): before the last one was submitted
            steady = decode_figures(before, drained) if drained else {}
            return records, wall, figures | {f"steady_{k}": v for k, v in steady.items()}

        warm = dataclasses.replace(base, max_new_tokens=min(WARMUP_TOKENS, prompts[0][2]))
        # the draft model's KV pool in this process (drafter_service/draft_kv.py): caches emptied for room, and
        # sessions that drafted nothing for want of blocks, per level
        kv = draft_kv(stack.draft_runner) if not spec.is_grpc and getattr(stack, "draft_runner", None) else None
        for n in levels:
            # warm-up at this N: the first forwards of its batch shapes allocate, page in and (CUDA) capture graphs
            level(n, prompts[:n], warm)
            kv_before = (kv.evictions, kv.starved) if kv is not None else None
            with (tqdm(total=len(prompts), desc=f"{spec.label} x{n}", unit="req", leave=False) as bar,
                  profiled(getattr(args, "profile", None), f"{spec.label}_x{n}")):
                records, wall, figures = level(n, prompts, base, bar)
            row = {"method": spec.label, "concurrency": n, "lossy": spec.lossy, **summarize(records, wall),
                   **figures}
            if kv is not None:
                row["draft_kv_evictions"] = kv.evictions - kv_before[0]
                row["draft_kv_starved"] = kv.starved - kv_before[1]
            if base.greedy:
                if spec.base_name == "ar" and n == levels[0]:
                    reference = {r["index"]: r["tokens"] for r in records}
                row["greedy_match_ar"] = (sum(reference.get(r["index"]) == r["tokens"] for r in records) / len(records)
                                          if reference else None)
                row["_outputs"] = {r["index"]: r["tokens"] for r in records}
            rows.append(row)
    if base.greedy and reference:
        for row in rows:
            # a lossy method differs from ar by design, not at near-ties
            if row.get("greedy_match_ar") is not None and row["greedy_match_ar"] < 1 and not row["lossy"]:
                row["divergence_gaps"] = divergence_gaps(stack.target_runner, prompts, reference, row.pop("_outputs"))
            row.pop("_outputs", None)
    for row in rows:
        ar = next((r for r in rows if r["method"] == "ar" and r["concurrency"] == row["concurrency"]), None)
        first = next(r for r in rows if r["method"] == row["method"])
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        row["scaling_vs_lowest"] = row["tokens_per_s"] / first["tokens_per_s"]
    return {"levels": levels, "rows": rows, "skipped": skipped}


def divergence_gaps(runner, prompts, reference: dict[int, list[int]], outputs: dict[int, list[int]]) -> list[dict]:
    """Where a greedy output differs from the reference: the first differing position and the target's top-2
    logit gap there (one unbatched forward over prompt + the common prefix). In bfloat16, batched and
    unbatched forwards round differently, so outputs may part at a near-tie; a large gap would be a bug."""
    import torch

    found = []
    for index, got in outputs.items():
        want = reference.get(index)
        if want is None or want == got:
            continue
        at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        context = list(prompts[index][1]) + list(want[:at])
        cache = runner.new_cache()
        logits = runner.forward(cache, context, range(len(context)), last_only=True)[-1]
        top = torch.topk(logits.float(), 2).values
        found.append({"index": index, "position": at, "top2_gap": float(top[0] - top[1])})
    return found


def load_table(report: dict) -> str:
    def fmt(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    lines = ["| method | concurrency | tokens/s | × ar | × lowest N | ITL p50 ms | ITL p99 ms | TTFT p50 ms | τ | "
             "nodes/step | mean batch | decode steps: batch / running | stepped ÷ running | "
             "while prompts last: batch / running | step ms: verifier / rest | drafter ms/step | greedy = ar |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['method']}{' (LOSSY)' if r.get('lossy') else ''} | {r['concurrency']} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup_vs_ar'])} | "
                     f"{fmt(r['scaling_vs_lowest'])} | {fmt(r['itl_p50_ms'], 1)} | {fmt(r['itl_p99_ms'], 1)} | "
                     f"{fmt(r['ttft_p50_ms'], 0)} | {fmt(r['tau'])} | {fmt(r.get('nodes_per_step'), 1)} | "
                     f"{fmt(r.get('mean_batch'))} | {fmt(r.get('decode_mean_batch'))} / {fmt(r.get('mean_running'))} | "
                     f"{fmt(r.get('stepped_per_running'), 3)} | "
                     f"{fmt(r.get('steady_decode_mean_batch'))} / {fmt(r.get('steady_mean_running'))} | "
                     f"{fmt(r.get('verifier_step_ms'))} / {fmt(r.get('host_ms_per_step'))} | "
                     f"{fmt(r.get('draft_ms_per_step'))} | "
                     f"{fmt(r.get('greedy_match_ar'))} |")
    if any(r.get("decode_steps") for r in report["rows"]):
        lines += ["", "mean batch: Verify calls per forward, prefill-only forwards included; decode steps: the forwards "
                      "with a request decoding, their Verify calls and requests decoding (in the step or not) per "
                      "forward; stepped ÷ running: the share of the decoding requests each one verified (1: none sat "
                      "a step out; running below N: requests prefilling, or finished once the prompts ran out); while "
                      "prompts last: the decode steps before the last prompt was submitted (N in flight; – with as "
                      "many prompts as N)"]
    for prefix, whose in (("graph", "target"), ("draft_graph", "draft model")):
        graphed = [r for r in report["rows"] if f"{prefix}_replays" in r and r[f"{prefix}_replays"] + r[f"{prefix}_eager"]]
        if graphed:
            lines += ["", f"CUDA graphs of the {whose} (forwards replayed / eager / buckets captured, their seconds): "
                      + "; ".join(f"{r['method']} x{r['concurrency']} {r[prefix + '_replays']} / {r[prefix + '_eager']} / "
                                  f"{r[prefix + '_captures']}, {r[prefix + '_capture_s']:.2f} s" for r in graphed)]
    gaps = [(r["method"], r["concurrency"], g) for r in report["rows"] for g in r.get("divergence_gaps", ())]
    if gaps:
        lines += ["", f"greedy outputs that differ from ar's: {len(gaps)}; top-2 logit gap of the target at the first "
                      f"difference: max {max(g['top2_gap'] for _, _, g in gaps):.3f}, median "
                      f"{float(np.median([g['top2_gap'] for _, _, g in gaps])):.3f} (near-ties: batched and unbatched "
                      f"forwards round differently)"]
    if report["skipped"]:
        lines += ["", "skipped (no batching across requests): " + ", ".join(report["skipped"])]
    return "\n".join(lines)
