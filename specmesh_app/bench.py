"""`specmesh bench`: speculative methods against autoregressive decoding and Hugging Face peers.

Every prompt runs through every method in one process, interleaved: for each prompt,
all methods in turn, the order rotated per prompt (and repeat) so slow drift of the
machine spreads evenly. Each method runs once untimed before timing starts.

Methods (``NAME`` or ``NAME:key=value,...``):
  ar                 plain decoding through the specmesh engine (the reference)
  <proposer>         any registered proposer; ``max_nodes`` / ``max_depth`` set the
                     static budget, other keys are proposer options; ``mjsd`` (LOSSY,
                     greedy only, never run unless named) also takes ``threshold``
  hf_ar              ``model.generate`` on the same target model
  hf_assisted        transformers assisted generation, ``assistant_model`` = the draft
                     model; ``num_assistant_tokens``, ``num_assistant_tokens_schedule``
                     and ``assistant_confidence_threshold`` go to the draft model's
                     generation config (where transformers reads them), other keys to
                     ``generate``; unset keys keep transformers' defaults
  hf_prompt_lookup   ``generate(prompt_lookup_num_tokens=...)``
  grpc:NAME          ``ar`` or a proposer through the client SDK and `specmesh serve`
                     (--server, or --spawn-mesh); keys max_nodes / max_depth

Definitions used in the report:
  tau        specmesh: committed tokens (accepted + bonus) per verification step, pooled
             over prompts (prefill excluded). HF: generated tokens / target forward
             calls, since HF assisted decoding folds the prefill into its first
             verification step (plain decoding gives 1.0 under both definitions).
  fwd/token  target forward passes per generated token, prefill included, counted the
             same way for every method (ForwardMeter).
  speedup    per prompt, the reference's time per generated token / the method's; with
             equal outputs (greedy, lossless) this is reference time / method time.
             Reference: specmesh ``ar``. grpc: methods are also compared with ``grpc:ar``
             (plain decoding through the same servers). HF methods are also compared with ``hf_ar``:
             against ``ar`` their ratio includes the forward implementation (specmesh's
             fast runner vs the transformers module), against ``hf_ar`` only speculation.
  time       wall clock (perf_counter) of the whole request incl. prefill; with
             --repeats R the fastest of R runs (filters interference from other
             processes). tok/s = generated tokens / time, summed over prompts.
  fractions  specmesh: the engine's draft / verify time over total time. HF: time inside
             draft / target model forward calls over total time (hook-measured; null
             draft fraction for prompt lookup, whose search is not a model call).
  loops      see ``is_loop``.
  overhead   grpc:NAME: (its time - NAME's time in process) / its verification steps, per
             prompt, when both ran the same steps; as a fraction of its own step time.
  lossy      a method whose output may differ from the target's own decoding (mjsd), marked
             so in the table and the JSON (``lossy``, ``acceptance``); its greedy_match_ar
             below 1 is expected, not a failure.
  perplexity the target's perplexity of a method's outputs: exp(sum of -log p_target(token |
             prompt, earlier output) / tokens generated), pooled over prompts, each output scored
             by one target forward (outside the timed runs). Computed for ar and every lossy
             method when one runs (the quality MJSD trades for speed), for all with --perplexity.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orchestrator.arguments import add_penalty_arguments, penalty_options
from specmesh.atomic_io import check_writable, write_text_atomic
from specmesh.sampling import SamplingParams
from specmesh_app.bench_load import load_table
from specmesh_app.bench_runners import (
    GRPC_PREFIX,
    HF_METHODS,
    ForwardMeter,
    MethodSpec,
    RunOutput,
    asked_sampling,
    measured_run,
    method_runner,
)

# Options of HF methods when the spec leaves them unset (specmesh budgets default per proposer in the
# proposer registry, drafter_service/proposer.py; HF assisted keeps transformers' own defaults).
HF_DEFAULT_OPTIONS: dict[str, dict[str, object]] = {"hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}
LOOP_WINDOW = 64  # tokens at the end of an output examined for a loop
LOOP_MAX_PERIOD = 32
LOOP_MIN_NGRAM = 4
WARMUP_TOKENS = 16
FEEDBACK_TOPK = 8  # top-k rows a spawned verifier reports (token recycling)


# ----------------------------------------------------------------- method specs
def method_names() -> list[str]:
    from drafter_service.proposer import proposer_names

    local = ["ar", *proposer_names()]
    return [*local, *HF_METHODS, *(GRPC_PREFIX + m for m in local)]


def needs_draft(name: str) -> bool:
    from drafter_service.proposer import proposer_spec

    base = name.removeprefix(GRPC_PREFIX)
    if base in HF_METHODS or base == "ar":
        return base == "hf_assisted"
    return proposer_spec(base).needs_draft_model


def default_methods(has_draft: bool) -> list[str]:
    """Every in-process method that needs nothing extra: AR, every registered proposer, the HF peers (those
    needing a draft model only with one; a feature head's only when named with its head: ``falcon:head=DIR``).
    grpc: methods run only when asked for."""
    return [m for m in method_names() if (has_draft or not needs_draft(m)) and not m.startswith(GRPC_PREFIX)
            and not MethodSpec(m, m).lossy and not needs_head(m)]  # a lossy method runs only when named


def needs_head(name: str) -> bool:
    from drafter_service.proposer import proposer_names, proposer_spec

    return name in proposer_names() and proposer_spec(name).needs_head


def parse_method(spec: str, known: Sequence[str]) -> MethodSpec:
    """``NAME`` or ``NAME:key=value,...``; unset budgets/options take the method's defaults."""
    prefix = GRPC_PREFIX if spec.strip().startswith(GRPC_PREFIX) else ""
    name, _, rest = spec.strip().removeprefix(prefix).partition(":")
    name = prefix + name
    if name not in known:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(known)}")
    options = dict(HF_DEFAULT_OPTIONS.get(name, {}))
    base = name.removeprefix(GRPC_PREFIX)
    if base not in HF_METHODS and base != "ar":
        from drafter_service.proposer import proposer_spec

        options["max_nodes"], options["max_depth"] = proposer_spec(base).default_budget
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method option {item!r} in {spec!r} is not KEY=VALUE")
        options[key.strip()] = _parse_value(value.strip())
    if base in ("ar", "hf_ar") and options:
        raise ValueError(f"{name} takes no options, got {spec!r}")
    return MethodSpec(spec.strip(), name, tuple(sorted(options.items())))


def plan_methods(labels: Sequence[str], has_draft: bool) -> list[MethodSpec]:
    """Parse the method specs, adding the references (``ar``; ``hf_ar`` when HF peers run)."""
    known = method_names()
    specs = [parse_method(label, known) for label in labels]
    if "ar" not in [s.label for s in specs]:
        specs.insert(0, parse_method("ar", known))  # every speedup is measured against it
    if any(s.is_hf for s in specs) and "hf_ar" not in [s.label for s in specs]:
        specs.append(parse_method("hf_ar", known))
    if any(s.is_grpc for s in specs) and "grpc:ar" not in [s.label for s in specs]:
        specs.append(parse_method("grpc:ar", known))
    if len({s.label for s in specs}) != len(specs):
        raise ValueError(f"duplicate methods in {list(labels)}")
    missing = [s.label for s in specs if needs_draft(s.name)] if not has_draft else []
    if missing:
        raise ValueError(f"these methods need a draft model (--draft DIR): {', '.join(missing)}")
    return specs


def _parse_value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


# ----------------------------------------------------------------- pure metrics
def is_loop(tokens: Sequence[int]) -> bool:
    """Whether an output has fallen into a loop. Pass the generated tokens without a final EOS.

    Only outputs of at least LOOP_WINDOW (64) tokens can loop. The last 64 tokens loop if
    (a) they repeat with a period p <= 32 (tail[i] == tail[i - p] for all i >= p, so at
        least two full periods), or
    (b) one n-gram (4 <= n <= 32) recurs so often that its occurrences cover more than
        half of the 64 positions, which catches loops with small variations (a counter
        that changes, two alternating lines with a stray token).
    """
    if len(tokens) < LOOP_WINDOW:
        return False
    tail = np.asarray(tokens[-LOOP_WINDOW:], dtype=np.int64)
    for p in range(1, LOOP_MAX_PERIOD + 1):
        if np.array_equal(tail[p:], tail[:-p]):
            return True
    for n in range(LOOP_MIN_NGRAM, LOOP_MAX_PERIOD + 1):
        starts: dict[bytes, list[int]] = {}
        for i in range(LOOP_WINDOW - n + 1):
            starts.setdefault(tail[i : i + n].tobytes(), []).append(i)
        for occurrences in starts.values():
            if len(occurrences) < 2:
                continue
            covered = np.zeros(LOOP_WINDOW, dtype=bool)
            for i in occurrences:
                covered[i : i + n] = True
            if covered.sum() * 2 > LOOP_WINDOW:
                return True
    return False


def spread(values: Sequence[float]) -> dict | None:
    """Median, p10/p90 and min/max of per-prompt values (None if there are none)."""
    if not values:
        return None
    v = np.asarray(values, dtype=np.float64)
    p10, median, p90 = np.percentile(v, [10, 50, 90])
    return {"median": float(median), "p10": float(p10), "p90": float(p90), "min": float(v.min()), "max": float(v.max())}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def aggregate(records: list[dict], greedy: bool) -> dict:
    """Per-method figures from one method's per-prompt records (see the module docstring)."""
    gen = sum(r["num_generated"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    hf = records[0]["kind"] == "hf"
    out: dict = {"num_prompts": len(records), "generated_tokens": gen, "seconds": seconds}
    if hf:
        out["tau"] = _ratio(gen, sum(r["target_forwards"] for r in records))
        out["acceptance_per_position"] = None
        out["per_source"] = None
        has_draft_model = any(r["draft_forwards"] for r in records)
        out["draft_time_fraction"] = _ratio(sum(r["draft_forward_seconds"] for r in records), seconds) if has_draft_model else None
        out["verify_time_fraction"] = _ratio(sum(r["target_forward_seconds"] for r in records), seconds)
        out["draft_errors"] = None
    else:
        out["tau"] = _ratio(sum(r["committed"] for r in records), sum(r["steps"] for r in records))
        depth = max((len(r["position_accepted"]) for r in records), default=0)
        accepted, reached = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
        for r in records:
            accepted[: len(r["position_accepted"])] += np.asarray(r["position_accepted"], np.int64)
            reached[: len(r["position_reached"])] += np.asarray(r["position_reached"], np.int64)
        out["acceptance_per_position"] = [float(a / n) if n else None for a, n in zip(accepted, reached, strict=True)]
        proposed: Counter[str] = Counter()
        accepted_by: Counter[str] = Counter()
        for r in records:
            for src, counts in r["per_source"].items():
                proposed[src] += counts["proposed"]
                accepted_by[src] += counts["accepted"]
        out["per_source"] = {s: {"proposed": proposed[s], "accepted": accepted_by[s]} for s in sorted(proposed)}
        out["draft_time_fraction"] = _ratio(sum(r["draft_seconds"] for r in records), seconds)
        out["verify_time_fraction"] = _ratio(sum(r["verify_seconds"] for r in records), seconds)
        out["draft_errors"] = sum(r["draft_errors"] for r in records)
        out.update(overlap_figures(records))
    out["tokens_per_second"] = _ratio(gen, seconds)
    out["target_forwards_per_token"] = _ratio(sum(r["target_forwards"] for r in records), gen)
    out["draft_forwards_per_token"] = _ratio(sum(r["draft_forwards"] for r in records), gen)
    out["speedup_vs_ar"] = spread([r["speedup_vs_ar"] for r in records if r["speedup_vs_ar"] is not None])
    nonloop = [r["speedup_vs_ar"] for r in records if r["speedup_vs_ar"] is not None and not r["ar_loops"]]
    out["speedup_vs_ar_nonlooping"] = spread(nonloop)
    out["greedy_match_ar"] = float(np.mean([r["match_ar"] for r in records])) if greedy else None
    if records[0]["kind"] == "grpc":
        out["speedup_vs_grpc_ar"] = spread([r["speedup_vs_grpc_ar"] for r in records if r["speedup_vs_grpc_ar"]])
        overhead = [r["overhead_ms_per_step"] for r in records if r["overhead_ms_per_step"] is not None]
        out["overhead_ms_per_step"] = spread(overhead)
        step_ms = [r["seconds"] / r["steps"] * 1e3 for r in records if r.get("steps")]
        out["overhead_fraction_of_step"] = (float(np.median(overhead)) / float(np.median(step_ms))
                                            if overhead and step_ms else None)
    if hf:
        out["speedup_vs_hf_ar"] = spread([r["speedup_vs_hf_ar"] for r in records if r["speedup_vs_hf_ar"] is not None])
        out["greedy_match_hf_ar"] = float(np.mean([r["match_hf_ar"] for r in records])) if greedy else None
    out["loop_fraction"] = float(np.mean([r["loops"] for r in records]))
    out["acceptance"] = records[0]["acceptance"]
    out["lossy"] = records[0]["lossy"]
    scored = [r for r in records if r.get("target_nll") is not None]
    out["perplexity"] = (float(np.exp(sum(r["target_nll"] for r in scored) / sum(r["num_generated"] for r in scored)))
                         if scored and sum(r["num_generated"] for r in scored) else None)
    return out


def overlap_figures(records: list[dict]) -> dict:
    """Idle fractions of the two sides, how much drafted-ahead work was used, the budgets chosen."""
    wall = sum(r["wall_seconds"] for r in records)
    depths = [d for r in records for d in r["budget_depths"]]
    return {
        "verifier_idle_fraction": 1 - _ratio(sum(r["verify_seconds"] for r in records), wall) if wall else None,
        "drafter_idle_fraction": 1 - _ratio(sum(r["drafter_busy_seconds"] for r in records), wall) if wall else None,
        "predrafted_step_fraction": _ratio(sum(r["predrafted_steps"] for r in records), sum(r["steps"] for r in records)),
        "predraft_used_fraction": _ratio(sum(r["predraft_used"] for r in records), sum(r["predraft_nodes"] for r in records)),
        "mean_budget_depth": float(np.mean(depths)) if depths else None,
    }


# ----------------------------------------------------------------- runners
def make_record(prompt_id: str, prompt_tokens: int, spec: MethodSpec, runs: list[RunOutput], eos: Sequence[int]) -> dict:
    best = min(runs, key=lambda r: r.seconds)  # the fastest run stands for all (same tokens, least interference)
    tokens = best.token_ids
    body = tokens[:-1] if tokens and tokens[-1] in eos else tokens
    rec = {
        "prompt_id": prompt_id,
        "method": spec.label,
        "kind": "hf" if spec.is_hf else "grpc" if spec.is_grpc else "specmesh",
        "prompt_tokens": prompt_tokens,
        "num_generated": len(tokens),
        "seconds": best.seconds,
        "seconds_all": [r.seconds for r in runs],
        "target_forwards": best.target_forwards,
        "target_forward_seconds": best.target_forward_seconds,
        "draft_forwards": best.draft_forwards,
        "draft_forward_seconds": best.draft_forward_seconds,
        "loops": is_loop(body),
        "token_ids": tokens,
        "acceptance": spec.acceptance,
        "lossy": spec.lossy,
        "target_nll": None,  # filled in by score_outputs when the method's perplexity is measured
    }
    rec["tokens_per_second"] = _ratio(len(tokens), rec["seconds"])
    if best.stats is not None:
        st = best.stats
        accepted, reached = st.position_counts()
        rec.update(
            steps=st.num_steps,
            committed=sum(s.num_accepted + 1 for s in st.steps),
            tau=st.tau if st.steps else None,
            position_accepted=accepted,
            position_reached=reached,
            per_source=st.per_source(),
            prefill_seconds=st.prefill_seconds,
            draft_seconds=st.draft_seconds,
            verify_seconds=st.verify_seconds,
            draft_errors=st.num_draft_errors,
            wall_seconds=st.wall_seconds,
            drafter_busy_seconds=sum(s.drafter_busy_seconds for s in st.steps),
            predrafted_steps=st.predrafted_steps,
            predraft_nodes=sum(s.predraft_nodes for s in st.steps),
            predraft_used=sum(s.predraft_used for s in st.steps),
            budget_depths=[b[1] for b in st.budgets()],
        )
    else:
        rec["tau"] = _ratio(len(tokens), best.target_forwards)
    return rec


def target_nll(runner, prompt: Sequence[int], output: Sequence[int]) -> float:
    """Sum over the output of -log p_target(token | prompt, earlier output tokens): one forward of prompt + output
    on a fresh cache, log-softmax in float64."""
    import torch

    if not output:
        return 0.0
    ids = list(prompt) + list(output[:-1])
    with torch.inference_mode():
        logits = runner.forward(runner.new_cache(), ids, range(len(ids)))[len(prompt) - 1 :]  # [len(output), vocab]
        logp = torch.log_softmax(logits.double(), dim=-1)
        picked = logp.gather(1, torch.as_tensor(list(output), device=logp.device)[:, None])
    return float(-picked.sum())


def score_outputs(runner, prompt: Sequence[int], records: dict[str, dict], specs: Sequence[MethodSpec],
                  all_methods: bool) -> None:
    """Fill in ``target_nll`` of one prompt's records: every method's with ``all_methods``, else ar's and the
    lossy methods' when any runs."""
    lossy = [s.label for s in specs if s.lossy]
    wanted = [s.label for s in specs] if all_methods else (["ar", *lossy] if lossy else [])
    for label in wanted:
        rec = records[label]
        rec["target_nll"] = target_nll(runner, prompt, rec["token_ids"])


def _speedup(ref: dict | None, rec: dict) -> float | None:
    """Reference time per token / method time per token."""
    if ref is None or not rec["num_generated"] or not ref["num_generated"] or not rec["seconds"]:
        return None
    return (ref["seconds"] / ref["num_generated"]) / (rec["seconds"] / rec["num_generated"])


def _overhead_ms_per_step(local: dict | None, remote: dict) -> float | None:
    """Extra wall time per verification step of the disaggregated run over the same method in process.
    Only meaningful when both ran the same steps (greedy, or sampling with the same seed)."""
    if local is None or not remote.get("steps") or local.get("steps") != remote["steps"]:
        return None
    return (remote["seconds"] - local["seconds"]) / remote["steps"] * 1e3


def compare_prompt(records: dict[str, dict], greedy: bool) -> None:
    """Fill in one prompt's cross-method fields (speedups, matches) in place."""
    ar, hf_ar, grpc_ar = records.get("ar"), records.get("hf_ar"), records.get("grpc:ar")
    for rec in records.values():
        if rec["kind"] == "grpc":
            rec["speedup_vs_grpc_ar"] = _speedup(grpc_ar, rec)
            rec["overhead_ms_per_step"] = _overhead_ms_per_step(records.get(rec["method"].removeprefix(GRPC_PREFIX)),
                                                                 rec)
        rec["ar_loops"] = ar["loops"]
        rec["speedup_vs_ar"] = _speedup(ar, rec)
        rec["match_ar"] = rec["token_ids"] == ar["token_ids"] if greedy else None
        if rec["kind"] == "hf":
            rec["speedup_vs_hf_ar"] = _speedup(hf_ar, rec)
            rec["match_hf_ar"] = (rec["token_ids"] == hf_ar["token_ids"]) if greedy and hf_ar else None


def load_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        if "id" not in row or "prompt" not in row:
            raise ValueError(f"{path}: every line needs 'id' and 'prompt'")
        messages = row.get("messages")
        if messages is not None and not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ValueError(f"{path}: {row['id']}: 'messages' must be a list of {{role, content}} objects")
    return rows[:limit] if limit else rows


def chat_messages(row: dict) -> list[dict]:
    """What ``--chat`` renders for a prompt row: its ``messages`` (a conversation, e.g. earlier turns and an
    answer sent back with a change request), else its ``prompt`` as the one user message. Without ``--chat``
    the row's ``prompt`` text is sent as it is."""
    return row.get("messages") or [{"role": "user", "content": row["prompt"]}]


def prompt_ids(tokenizer, template, row: dict) -> list[int]:
    """A prompt row's token ids: its ``prompt`` as raw text (``template`` None), else ``chat_messages(row)`` rendered
    by ``template`` (the rendered text holds its special tokens)."""
    if template is None:
        return tokenizer.encode(row["prompt"])
    return tokenizer.encode(template.render(chat_messages(row), add_generation_prompt=True), add_special_tokens=False)


def run_bench(args: argparse.Namespace) -> dict:
    from orchestrator.arguments import resolve_models
    from orchestrator.embedded import load_stack

    target_dir, draft_dir = resolve_models(args)
    try:  # usage errors: one line, no traceback
        specs = plan_methods(args.methods or default_methods(draft_dir is not None), draft_dir is not None)
        if args.ignore_eos and args.concurrency is None:
            raise ValueError("--ignore-eos applies to load mode (--concurrency) only: the per-prompt comparison's "
                             "Hugging Face peers stop at the end-of-sequence token")
        base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              logprobs=args.logprobs, ignore_eos=args.ignore_eos, **penalty_options(args))
        for spec in specs:  # a lossy method is greedy only; a threshold only for it
            asked_sampling(spec, base)
        rows = load_prompts(Path(args.prompts), args.limit)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"specmesh bench: {exc}") from None

    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    stack = load_stack(args, hf_modules=any(s.is_hf for s in specs))  # HF peers run the transformers modules
    with contextlib.ExitStack() as resources:
        client = _grpc_client(args, specs, target_dir, draft_dir, resources)

        def runners() -> dict:
            return {s.label: method_runner(stack, s, client) for s in specs}

        return _bench_loop(args, specs, stack, runners, rows, base, target_dir, draft_dir, client)


def _grpc_client(args, specs, target_dir, draft_dir, resources: contextlib.ExitStack):
    """A client of `specmesh serve` when grpc: methods run: --server, or a mesh spawned here."""
    if not any(s.is_grpc for s in specs):
        return None
    from specmesh.client import Client
    from specmesh_app.local_mesh import LocalMesh

    address = args.server
    if address is None:
        if not args.spawn_mesh:
            raise SystemExit("specmesh bench: grpc: methods need --server HOST:PORT or --spawn-mesh")
        threads = ["--threads", str(args.threads)] if args.threads else []
        device = ["--device", args.device, "--attention", args.attention, "--compile", args.compile_layers,
                  "--cuda-graphs", args.cuda_graphs]
        verifier = ["--target", str(target_dir), "--dtype", args.dtype, "--runner", args.runner, *threads, *device]
        drafter = ["--draft", str(draft_dir) if draft_dir else "none", "--draft-dtype", args.draft_dtype,
                   "--runner", args.runner, *threads, *device]
        print("starting a local mesh (verifier, drafter, serve)...", file=sys.stderr)
        # the verifier reports top-k rows (token recycling), the drafter shares this command's n-gram store
        verifier += ["--feedback-topk", str(FEEDBACK_TOPK)]
        if args.lookahead is not None:
            verifier += ["--lookahead", f"{args.lookahead.window},{args.lookahead.ngram}"]
        drafter += ["--tokenizer", str(target_dir)] + (["--ngram-store", args.ngram_store] if args.ngram_store else [])
        mesh = resources.enter_context(LocalMesh(verifier, drafter, ["--tokenizer", str(target_dir)]))
        address = mesh.address
    return resources.enter_context(Client(address))


def _bench_loop(args, specs, stack, make_runners, rows, base, target_dir, draft_dir, client) -> dict:
    from tqdm import tqdm

    eos = stack.target_runner.info.eos_token_ids

    template = _chat_template(args, target_dir)
    prompts = []
    for row in rows:
        ids = prompt_ids(stack.tokenizer, template, row)
        max_new = args.max_new_tokens or int(row.get("max_new_tokens", 128))
        if len(ids) + max_new + 1 > stack.target_runner.info.max_positions:
            print(f"skipping {row['id']}: {len(ids)} prompt tokens + {max_new} do not fit the context", file=sys.stderr)
            continue
        prompts.append((row["id"], ids, max_new))
    if not prompts:
        raise SystemExit("specmesh bench: no prompts to run")
    if args.concurrency is not None:
        from specmesh_app.bench_load import run_load_bench

        try:
            load = run_load_bench(args, specs, stack, prompts, base, client)
        finally:
            stack.close()
        return {"config": _config(args, specs, stack, target_dir, draft_dir, base, prompts, client),
                "environment": environment(), "load": load}

    target_meter, draft_meter = ForwardMeter(stack.target_runner), ForwardMeter(stack.draft_runner)
    try:
        _, warm_ids, warm_new = prompts[0]
        warm = dataclasses.replace(base, max_new_tokens=min(WARMUP_TOKENS, warm_new))
        warm_runners = make_runners()
        for spec in tqdm(specs, desc="warm-up", unit="method", file=sys.stderr, leave=False):
            warm_runners[spec.label].run(warm_ids, warm)
        # fresh proposers for the timed runs: learning ones (n-gram stores, token recycling) start from
        # what they were configured with, not from the warm-up's output (in this process; a spawned
        # or remote drafter keeps learning across methods and passes)
        runners = make_runners()

        records: list[dict] = []
        for p in range(args.passes):
            desc = "bench" if args.passes == 1 else f"bench pass {p + 1}/{args.passes}"
            for i, (pid, ids, max_new) in enumerate(tqdm(prompts, desc=desc, unit="prompt", file=sys.stderr)):
                seed = None if base.seed is None else base.seed + i
                sampling = dataclasses.replace(base, max_new_tokens=max_new, seed=seed)
                runs: dict[str, list[RunOutput]] = {s.label: [] for s in specs}
                for r in range(args.repeats):
                    shift = (i * args.repeats + r) % len(specs)
                    for spec in specs[shift:] + specs[:shift]:
                        runs[spec.label].append(measured_run(runners[spec.label], ids, sampling, target_meter,
                                                             draft_meter))
                by_label = {s.label: make_record(pid, len(ids), s, runs[s.label], eos) for s in specs}
                compare_prompt(by_label, base.greedy)
                score_outputs(stack.target_runner, ids, by_label, specs, args.perplexity)
                for rec in by_label.values():
                    rec["pass"] = p + 1
                records += by_label.values()
    finally:
        target_meter.close()
        draft_meter.close()

    methods = {}
    for p in range(1, args.passes + 1):
        for s in specs:
            label = s.label if p == 1 else f"{s.label} (pass {p})"
            methods[label] = aggregate([r for r in records if r["method"] == s.label and r["pass"] == p], base.greedy)
    return {
        "config": _config(args, specs, stack, target_dir, draft_dir, base, prompts, client),
        "environment": environment(),
        "methods": methods,
        "records": records,
    }


def _chat_template(args, target_dir):
    """``--chat``: the target's chat template (SystemExit when it has none), else None."""
    if not getattr(args, "chat", False):
        return None
    from specmesh.chat import ChatTemplate, ChatTemplateError

    try:
        template = ChatTemplate.load(target_dir)
    except ChatTemplateError as exc:
        raise SystemExit(f"specmesh bench: --chat: {exc}") from None
    if template is None:
        raise SystemExit(f"specmesh bench: --chat: {target_dir} has no chat template")
    return template


def _config(args, specs, stack, target_dir, draft_dir, base, prompts, client) -> dict:
    """The report's record of what ran."""
    return {
        "prompts": str(args.prompts),
        "target": str(target_dir),
        "draft": str(draft_dir) if draft_dir else None,
        "runner": type(stack.target_runner).__name__,
        # the fast runner's resolved attention backend and whether its layers are torch.compiled
        "attention": getattr(stack.target_runner, "attention", None),
        "compiled": getattr(stack.target_runner, "compiled", False),
        "cuda_graphs": getattr(stack.target_runner, "cuda_graphs", "off"),
        "device": str(stack.target_runner.device),
        "dtype": str(stack.target_runner.dtype),
        "draft_dtype": str(stack.draft_runner.dtype) if stack.draft_runner else None,
        "methods": [{"label": s.label, "name": s.name, "options": dict(s.options)} for s in specs],
        "sampling": dataclasses.asdict(base),
        "max_new_tokens_override": args.max_new_tokens,
        "limit": args.limit,
        "repeats": args.repeats,
        "passes": args.passes,
        "ngram_store": args.ngram_store,
        "lookahead": None if args.lookahead is None else dataclasses.asdict(args.lookahead),
        "num_prompts": len(prompts),
        "chat": bool(getattr(args, "chat", False)),
        "server": client.address if client is not None else None,
        "concurrency": args.concurrency,
        "prefix_caching": getattr(stack, "prefix_caching", True),
    }


def environment() -> dict:
    import importlib.util

    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # without scikit-learn, transformers keeps assistant_confidence_threshold fixed instead of adapting it
        "sklearn_available": importlib.util.find_spec("sklearn") is not None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ----------------------------------------------------------------- report
def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown_table(report: dict) -> str:
    lines = [
        "| method | τ | tok/s | speedup median [p10–p90] | greedy_match_ar | fwd/token | target ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, m in report["methods"].items():
        sp = m["speedup_vs_ar"]
        speed = "–" if sp is None else f"{sp['median']:.2f} [{sp['p10']:.2f}–{sp['p90']:.2f}]"
        name = f"{label} (LOSSY)" if m.get("lossy") else label
        lines.append(
            f"| {name} | {_fmt(m['tau'])} | {_fmt(m['tokens_per_second'], 1)} | {speed} "
            f"| {_fmt(m['greedy_match_ar'])} | {_fmt(m['target_forwards_per_token'])} | {_fmt(m.get('perplexity'))} |"
        )
    methods = report["methods"]
    notes = []
    lossy = [k for k, m in methods.items() if m.get("lossy")]
    if lossy:
        notes.append(f"LOSSY (output differs from the target's own decoding by design; greedy_match_ar < 1 is "
                     f"expected): {', '.join(lossy)}. target ppl = the target's perplexity of each method's outputs "
                     "(ar = the target's own greedy output)")
    if "ar" in methods:
        notes.append(f"AR outputs that loop: {methods['ar']['loop_fraction']:.0%} of {methods['ar']['num_prompts']} prompts")
    grpc = [f"{k} {m['speedup_vs_grpc_ar']['median']:.2f}" for k, m in methods.items() if m.get("speedup_vs_grpc_ar")]
    if grpc:
        notes.append("speedup vs grpc:ar (median): " + ", ".join(grpc))
    over = [f"{k} {m['overhead_ms_per_step']['median']:.2f} ms ({m['overhead_fraction_of_step']:.0%})"
            for k, m in methods.items() if m.get("overhead_ms_per_step")]
    if over:
        notes.append("gRPC overhead per step vs in-process (median, share of the step): " + ", ".join(over))
    idle = [f"{k} {m['verifier_idle_fraction']:.0%}/{m['drafter_idle_fraction']:.0%}"
            + (f" (ahead: {m['predrafted_step_fraction']:.0%} of steps, {m['predraft_used_fraction']:.0%} of nodes used)"
               if m.get("predraft_used_fraction") is not None and m.get("predrafted_step_fraction") else "")
            for k, m in methods.items() if m.get("verifier_idle_fraction") is not None and k not in ("ar", "grpc:ar")]
    if idle:
        notes.append("idle verifier/drafter: " + ", ".join(idle))
    sources = [f"{k}: " + ", ".join(f"{s} {c['accepted']}/{c['proposed']}" for s, c in m["per_source"].items())
               for k, m in methods.items() if m.get("per_source") and len(m["per_source"]) > 1]
    if sources:
        notes.append("accepted/proposed nodes per source: " + "; ".join(sources))
    hf = [f"{k} {m['speedup_vs_hf_ar']['median']:.2f}" for k, m in methods.items() if m.get("speedup_vs_hf_ar")]
    if hf:
        notes.append("speedup vs hf_ar (median): " + ", ".join(hf))
    return "\n".join(lines + [""] + notes)


# ----------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Bench options; the model options (--target, --draft, --runner, --dtype, --threads) come from specmesh_app.cli."""
    parser.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="JSONL with id, prompt, max_new_tokens")
    parser.add_argument("--methods", nargs="+", metavar="SPEC",
                        help="NAME or NAME:key=value,... with NAME one of ar, a proposer (keys: max_nodes, max_depth, "
                        "proposer options), hf_ar, hf_assisted (keys: num_assistant_tokens, "
                        "assistant_confidence_threshold, ...), hf_prompt_lookup (prompt_lookup_num_tokens, "
                        "max_matching_ngram_size); mjsd is LOSSY (greedy only; keys beam_width, draft_length, "
                        "threshold) and runs only when named. Default: all of them but the lossy ones; ar and hf_ar "
                        "are added when missing")
    parser.add_argument("--limit", type=int, help="first N prompts only")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (+1 per prompt)")
    add_penalty_arguments(parser)
    parser.add_argument("--logprobs", type=int, default=None, metavar="K",
                        help="every request asks for its tokens' log-probabilities and K alternatives (their cost is "
                             "part of the timing; default: none)")
    parser.add_argument("--max-new-tokens", type=int, help="override every prompt's max_new_tokens")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="with --concurrency: every request generates its max_new_tokens, past the end-of-sequence "
                             "token, as benchmarks/vllm_peer.py's requests do; compare tokens/s with a peer on the same "
                             "number of tokens (without it a request ends at EOS, and the prompts' prefill is spread "
                             "over fewer tokens)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method; the fastest counts")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the whole prompt set this many times with the same proposers, reported per pass: "
                             "the later passes show what learning drafters (retrieval, recycling, fused) gained from "
                             "the earlier ones (default: 1)")
    parser.add_argument("--json", required=True, metavar="OUT.json", help="write the full report here")
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="`specmesh serve` that grpc:NAME methods go through (token from $SPECMESH_TOKEN)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="N",
                        help="load mode: for each N, run the prompts with N requests in flight (N client threads; "
                             "embedded methods share one engine core, grpc: ones go through serve) and report "
                             "aggregate tokens/s, per-token latency p50/p99, TTFT, tau and the verifier's mean batch "
                             "per method and N, instead of the per-prompt comparison (default: off)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="with --concurrency: run each method and level under torch.profiler and write DIR/"
                             "METHOD_xN.txt, the operators by self CPU time (and by CUDA time on a GPU); the "
                             "timings of a profiled run are inflated (default: off)")
    parser.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                        help="with --concurrency: the KV pool of the shared in-process verifier, as `specmesh "
                             "verifier --kv-cache-gb` (default: the verifier's)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="with --concurrency: the in-process verifier caches no prompt prefix, so every level "
                             "and method pays its prompts' prefill (by default the prompts, the same at every level "
                             "and method, are found cached after the first: compare with a peer that caches them "
                             "too, e.g. `vllm_peer.py --prefix-caching`; the JSON counts each row's "
                             "prefix_cache_hit_tokens)")
    parser.add_argument("--chat", action="store_true",
                        help="send every prompt as a user message in the target's chat template (with the "
                             "assistant's turn opened), as the OpenAI chat endpoint does, or a row's 'messages' (a "
                             "conversation) when it has them; default: raw text")
    parser.add_argument("--perplexity", action="store_true",
                        help="score every method's outputs with the target's perplexity (one target forward per "
                             "output, outside the timed runs); without it only ar and the lossy methods (mjsd) are "
                             "scored, and only when a lossy method runs")
    parser.add_argument("--spawn-mesh", action="store_true",
                        help="for grpc:NAME methods, start a verifier, a drafter and serve on 127.0.0.1 with this "
                             "command's model options, and stop them at the end")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.passes < 1:
        raise SystemExit("specmesh bench: --repeats and --passes must be >= 1")
    if args.concurrency is not None and min(args.concurrency) < 1:
        raise SystemExit("specmesh bench: --concurrency values must be >= 1")
    try:  # a bad --json path is refused now, not after the whole run (a missing directory is created)
        check_writable(args.json, make_parents=True)
    except OSError as exc:
        raise SystemExit(f"specmesh bench: --json {args.json}: {exc.strerror or exc}") from None
    report = run_bench(args)
    report["table"] = markdown_table(report) if args.concurrency is None else load_table(report["load"])
    print(report["table"])  # first: a write that still fails (a full disk) loses the JSON, not the table
    try:
        write_text_atomic(args.json, json.dumps(report, indent=1))
    except OSError as exc:
        raise SystemExit(f"specmesh bench: --json {args.json}: {exc.strerror or exc} "
                         "(the file is unchanged)") from None
    return 0
