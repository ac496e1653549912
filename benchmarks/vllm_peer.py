"""vLLM-CPU peer benchmark: plain greedy decoding of the benchmark target at fixed concurrency.

What it measures: for each concurrency N, the prompts go through one vLLM engine (AsyncLLM, V1,
continuous batching) driven by N closed-loop clients: each client submits a request, streams it to
the end, then takes the next prompt, so exactly min(N, prompts left) requests are in flight. Greedy
(temperature 0), ignore_eos, so every request generates exactly max_new_tokens. Per concurrency:

- tok/s: generated tokens of all requests / wall time (first submit to last token);
- ITL p50/p99: inter-token latency, the client-side gaps between consecutive streamed tokens of a
  request, pooled over all requests (a gap that brought k tokens counts as k gaps of gap/k);
- TPOT p50: per request (last token - first token) / (tokens - 1), median over requests;
- TTFT p50: submit to first token, median over requests.

A warm-up pass at the highest concurrency runs before anything is timed; prefix caching is off
(unless --prefix-caching), so repeated prompts are prefilled every time, as in specmesh.

Standalone: it must not import specmesh. Run it with the vLLM venv's python (recipe in
DEVELOPERS.md, "vLLM-CPU peer"), from the repository root:

    /work/vllm-venv/bin/python benchmarks/vllm_peer.py --limit 16 --max-new-tokens 128 \
        --concurrency 1 4 16 --json benchmarks/results/vllm_cpu_peer.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "../shared/models/stdlib-code/target"
DEFAULT_PROMPTS = REPO / "../shared/data/stdlib_functions.jsonl"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="target model: local Hugging Face directory")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                   help="JSONL with fields id, prompt, max_new_tokens")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per request (overrides each prompt's max_new_tokens)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                   help="concurrency levels: requests in flight at once")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations dtype")
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="tokens per request of the untimed warm-up pass at the highest concurrency")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size (VLLM_CPU_KVCACHE_SPACE, GiB)")
    p.add_argument("--omp-bind", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                   help="VLLM_CPU_OMP_THREADS_BIND: 'auto' on 2 cores gives the model 1 core and leaves "
                        "1 for the engine and this client; e.g. '0-1' gives the model both")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (vLLM's eager mode)")
    p.add_argument("--prefix-caching", action="store_true", help="enable vLLM's prefix caching")
    p.add_argument("--ngram", type=int, default=0, metavar="K",
                   help="vLLM's n-gram speculative decoding (prompt lookup) with K speculative tokens per step, "
                        "matching 1 to --ngram-max tokens of the context; 0 = plain decoding")
    p.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched with --ngram")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message in the model's chat template (assistant turn opened), "
                        "or a row's 'messages' (a conversation) when it has them, as specmesh bench --chat does")
    p.add_argument("--json", metavar="OUT", default=None, help="write summary and per-request records here")
    return p.parse_args()


def pct(xs: list[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def run_level(engine: Any, prompts: list[dict], concurrency: int, tag: str) -> tuple[dict, list[dict]]:
    """Drive `engine` with `concurrency` closed-loop streaming clients over `prompts`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    queue: asyncio.Queue[dict] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[dict] = []

    async def client() -> None:
        while not queue.empty():
            p = queue.get_nowait()
            sp = SamplingParams(temperature=0.0, max_tokens=p["max_new_tokens"], ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
            t0 = time.perf_counter()
            stamps: list[tuple[float, int]] = []  # (arrival time, tokens in this delta)
            tokens: list[int] = []
            async for out in engine.generate({"prompt_token_ids": p["ids"]}, sp, f"{tag}-{p['id']}"):
                new = list(out.outputs[0].token_ids)
                if new:
                    stamps.append((time.perf_counter(), len(new)))
                    tokens.extend(new)
            gaps = [(t - tp) / k for (tp, _), (t, k) in zip(stamps, stamps[1:], strict=False) for _ in range(k)]
            records.append({"id": p["id"], "prompt_tokens": len(p["ids"]), "tokens": len(tokens),
                            "start": t0, "first": stamps[0][0], "last": stamps[-1][0],
                            "ttft_s": stamps[0][0] - t0,
                            "tpot_s": (stamps[-1][0] - stamps[0][0]) / max(len(tokens) - 1, 1),
                            "gaps_s": gaps, "token_ids": tokens})

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    gen = sum(r["tokens"] for r in records)
    gaps = [g for r in records for g in r["gaps_s"]]
    summary = {"concurrency": concurrency, "requests": len(records), "generated_tokens": gen,
               "wall_s": wall, "tokens_per_s": gen / wall,
               "itl_p50_ms": 1e3 * pct(gaps, 50), "itl_p99_ms": 1e3 * pct(gaps, 99),
               "tpot_p50_ms": 1e3 * statistics.median(r["tpot_s"] for r in records),
               "tpot_p99_ms": 1e3 * pct([r["tpot_s"] for r in records], 99),
               "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in records)}
    for r in records:  # keep the JSON small: per-request summaries + tokens, no raw gaps
        del r["gaps_s"]
    records.sort(key=lambda r: r["id"])
    return summary, records


async def bench(args: argparse.Namespace, prompts: list[dict]) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    max_len = max(len(p["ids"]) + p["max_new_tokens"] for p in prompts)
    speculative = None if not args.ngram else {
        "method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_min": 1,
        "prompt_lookup_max": args.ngram_max}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=max(max_len, args.warmup_tokens + 1),
        max_num_seqs=max(args.concurrency), enable_prefix_caching=args.prefix_caching,
        enforce_eager=args.enforce_eager, disable_log_stats=True, seed=0, speculative_config=speculative))
    try:
        warm = [dict(p, max_new_tokens=args.warmup_tokens) for p in prompts[:max(args.concurrency)]]
        await run_level(engine, warm, max(args.concurrency), "warmup")
        levels, records = [], {}
        for n in args.concurrency:
            summary, recs = await run_level(engine, prompts, n, f"c{n}")
            ref = records.get(str(args.concurrency[0]))
            if ref is not None:  # greedy outputs should not depend on the batch (fp32: expect all)
                summary["same_tokens_as_first_level"] = sum(
                    a["token_ids"] == b["token_ids"] for a, b in zip(ref, recs, strict=True))
            levels.append(summary)
            records[str(n)] = recs
            print(f"c={n}: {summary['tokens_per_s']:.1f} tok/s in {summary['wall_s']:.1f} s", flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # else AsyncLLM.__del__ runs at interpreter exit and raises
    return {"levels": levels, "records": records}


def table(levels: list[dict]) -> str:
    base = levels[0]["tokens_per_s"]
    rows = ["| concurrency | requests | tokens | wall s | tok/s | × first | ITL p50 ms | ITL p99 ms "
            "| TPOT p50 ms | TTFT p50 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in levels:
        rows.append(f"| {s['concurrency']} | {s['requests']} | {s['generated_tokens']} | {s['wall_s']:.1f} "
                    f"| {s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base:.2f} | {s['itl_p50_ms']:.2f} "
                    f"| {s['itl_p99_ms']:.2f} | {s['tpot_p50_ms']:.2f} | {s['ttft_p50_ms']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    import torch
    import vllm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.prompts) as f:
        prompts = [json.loads(line) for line in f if line.strip()][: args.limit]
    for p in prompts:  # tokenized here, like specmesh bench
        if args.chat:  # the rendered template holds its special tokens
            messages = p.get("messages") or [{"role": "user", "content": p["prompt"]}]  # a row's conversation
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            p["ids"] = tok(text, add_special_tokens=False).input_ids
        else:
            p["ids"] = tok(p["prompt"]).input_ids
        if args.max_new_tokens is not None:
            p["max_new_tokens"] = args.max_new_tokens
    result = asyncio.run(bench(args, prompts))
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings.update(vllm=vllm.__version__, torch=torch.__version__, cpus=os.cpu_count(),
                    date=datetime.datetime.now().isoformat(timespec="seconds"))
    print(f"\nvllm-cpu {vllm.__version__}, torch {torch.__version__}, dtype {args.dtype}, "
          f"{len(prompts)} prompts, omp-bind {args.omp_bind}"
          + (f", n-gram speculation k={args.ngram}" if args.ngram else "") + (", chat" if args.chat else ""))
    print(table(result["levels"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, **result}, indent=1) + "\n")


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: the guard is required
    main()
