"""vLLM-CPU peer of benchmarks/structured_output.py: the same chat prompts and JSON Schemas through vLLM's
structured outputs (xgrammar), greedy, one request at a time, with and without the schema.

Standalone (it must not import specmesh): run it with the vLLM venv's python (DEVELOPERS.md, "vLLM-CPU peer")
on the prompts ``structured_output.py --export`` wrote:

    python benchmarks/structured_output.py --target DIR --limit 50 --export /tmp/so.jsonl
    /work/vllm-venv/bin/python benchmarks/vllm_structured.py --model DIR --prompts /tmp/so.jsonl \\
        --json benchmarks/results/structured_output_vllm_cpu.json

Reports schema-valid share and tokens/s (generated tokens over the summed request times), constrained and not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    import jsonschema
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False)
    warm = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json_object=True))
    llm.chat(rows[0]["messages"], warm, use_tqdm=False)
    records = []
    for row in rows:
        for constrained in (True, False):
            so = StructuredOutputsParams(json=row["schema"], disable_any_whitespace=True) if constrained else None
            sp = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, structured_outputs=so)
            started = time.perf_counter()
            out = llm.chat(row["messages"], sp, use_tqdm=False)[0].outputs[0]
            seconds = time.perf_counter() - started
            try:
                jsonschema.validate(json.loads(out.text), row["schema"])
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            records.append({"entity": row["entity"], "constrained": constrained, "tokens": len(out.token_ids),
                            "seconds": seconds, "valid": valid, "text": out.text})
    lines = ["| vLLM-CPU | schema-valid | tok/s |", "|---|---|---|"]
    table = []
    for constrained in (True, False):
        mine = [r for r in records if r["constrained"] == constrained]
        row = {"constrained": constrained, "valid": sum(r["valid"] for r in mine) / len(mine),
               "tokens_per_second": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)}
        table.append(row)
        lines.append(f"| {'json_schema' if constrained else 'no grammar'} | {row['valid']:.0%} | "
                     f"{row['tokens_per_second']:.1f} |")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "table": table,
                                         "records": records}, indent=1))


if __name__ == "__main__":
    main()
