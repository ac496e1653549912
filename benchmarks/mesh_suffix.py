"""Suffix decoding across drafter replicas: does a request on replica B reuse what replica A wrote? (issue 69 (e))

Two layouts of the same mesh on 127.0.0.1, each started fresh (its own redis-server, so no layout sees the other's
outputs): one verifier of the target, and

- ``one``: one drafter (``--proposers suffix``, the fleet log in Redis) behind one `specmesh serve`;
- ``two``: two such drafters, each behind its own `specmesh serve`, over the same verifier and the same Redis.

Each layout runs ``--passes`` passes over the prompts, one request at a time, greedy, ``overlap`` off (so τ is a
function of the trees alone, not of the drafting thread's timing). In ``two``, request i of pass p goes to replica
(i + p) % 2: every prompt's second request lands on the replica that did not write its first answer, which it can
only know through the fleet log (``drafter_service/suffix_log.py``: each replica XADDs the outputs it closes, and
every replica's follower folds the others' into its global index). The report is τ (committed tokens per
verification step) per pass and layout; the goal is ``two`` within 10 % of ``one`` in every pass. Outputs are
checked equal between the layouts (greedy: the drafts never change them).

    python benchmarks/mesh_suffix.py --target ~/.cache/specmesh-bench/smollm2-135m-instruct/hf \\
        --prompts benchmarks/data/editing.jsonl --limit 8 --json benchmarks/results/suffix_mesh_smollm2.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from specmesh_app.local_mesh import LocalRedis, ServiceProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOG_WAIT_S = 5.0  # how long a replica's follower may take to read the other's last output before the next pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (with its tokenizer and chat template)")
    p.add_argument("--prompts", default=str(REPO / "benchmarks/data/editing.jsonl"),
                   help="JSONL rows with 'prompt' (and 'messages' for a conversation)")
    p.add_argument("--limit", type=int, default=8, help="first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--passes", type=int, default=2, help="passes over the prompts per layout")
    p.add_argument("--dtype", default="float32", help="the verifier's --dtype")
    p.add_argument("--threads", type=int, default=1, help="the verifier's --threads")
    p.add_argument("--raw", action="store_true", help="send the prompts as raw text (default: the chat template)")
    p.add_argument("--json", metavar="OUT", default=None, help="write settings, per-pass τ and per-request rows here")
    return p.parse_args()


def encode_prompts(args) -> list[tuple[str, list[int]]]:
    from specmesh.chat import ChatTemplate
    from specmesh.models import load_tokenizer
    from specmesh_app.bench import prompt_ids

    tokenizer = load_tokenizer(args.target)
    template = None if args.raw else ChatTemplate.load(args.target)
    if template is None and not args.raw:
        raise SystemExit(f"{args.target} has no chat template (pass --raw)")
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.limit]
    return [(row["id"], prompt_ids(tokenizer, template, row)) for row in rows]


def run_layout(args, replicas: int, prompts: list[tuple[str, list[int]]]) -> dict:
    """Start the layout, run its passes, stop it: per pass τ and tokens, per request its replica and tokens."""
    from specmesh.client import Client

    services: list[ServiceProcess] = []
    redis = LocalRedis()
    try:
        verifier = ServiceProcess(["-m", "specmesh", "verifier", "--target", args.target, "--dtype", args.dtype,
                                   "--threads", str(args.threads)], name="verifier")
        services.append(verifier)
        store = f"redis://127.0.0.1:{redis.port}"
        drafters = [ServiceProcess(["-m", "specmesh", "drafter", "--draft", "none", "--proposers", "suffix",
                                    "--default-proposer", "suffix", "--tokenizer", args.target, "--threads", "1",
                                    "--ngram-store", store], name=f"drafter {i}") for i in range(replicas)]
        services += drafters
        for service in services:
            service.wait_ready()
        serves = [ServiceProcess(["-m", "specmesh", "serve", "--verifier", verifier.address, "--drafter", d.address,
                                  "--tokenizer", args.target, "--proposer", "suffix"], name=f"serve {i}")
                  for i, d in enumerate(drafters)]
        services += serves
        for service in serves:
            service.wait_ready()
        clients = [Client(s.address) for s in serves]
        passes, records = [], []
        for p in range(args.passes):
            steps = tokens = 0
            for i, (row_id, ids) in enumerate(prompts):
                replica = (i + p) % replicas
                done = clients[replica].generate(ids, max_new_tokens=args.max_new_tokens, proposer="suffix",
                                                 overlap=False, timeout=600)
                n_steps = int(done.stats.get("steps", 0))
                steps += n_steps
                tokens += len(done.token_ids) - 1  # the first token is the prefill's
                records.append({"pass": p + 1, "id": row_id, "replica": replica, "tokens": len(done.token_ids),
                                "steps": n_steps, "tau": done.stats.get("tau"), "token_ids": done.token_ids})
            passes.append({"pass": p + 1, "tau": tokens / max(steps, 1), "steps": steps, "tokens": tokens})
            time.sleep(LOG_WAIT_S if replicas > 1 else 0.0)  # the followers read the last outputs of the pass
        for client in clients:
            client.close()
        return {"replicas": replicas, "passes": passes, "records": records}
    finally:
        for service in reversed(services):
            service.stop()
        redis.stop()


def main() -> int:
    args = parse_args()
    prompts = encode_prompts(args)
    layouts = {}
    for name, replicas in (("one", 1), ("two", 2)):
        started = time.perf_counter()
        layouts[name] = run_layout(args, replicas, prompts)
        print(f"{name}: {[round(p['tau'], 2) for p in layouts[name]['passes']]} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(layouts["one"]["records"], layouts["two"]["records"],
                                                            strict=True)]
    lines = ["| pass | τ one replica | τ two replicas (alternating) | two ÷ one |", "|---|---:|---:|---:|"]
    for a, b in zip(layouts["one"]["passes"], layouts["two"]["passes"], strict=True):
        lines.append(f"| {a['pass']} | {a['tau']:.2f} | {b['tau']:.2f} | {b['tau'] / a['tau']:.2f} |")
    lines.append(f"\noutputs equal between the layouts: {sum(same)}/{len(same)}")
    print("\n".join(lines))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        settings["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        summary = {name: layout["passes"] for name, layout in layouts.items()}
        for layout in layouts.values():
            for record in layout["records"]:
                record.pop("token_ids")  # the summary keeps what the status page needs
        Path(args.json).write_text(json.dumps({"settings": settings, "summary": summary, "outputs_equal": sum(same),
                                               "requests": len(same), "layouts": layouts}, indent=1) + "\n")
    return 0 if all(same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
