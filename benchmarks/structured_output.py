"""Structured output on a real chat model: JSON-Schema records, schema-valid rate, τ and speed against constrained
plain decoding, with and without the grammar proposer (issue 36).

Ten record schemas (3 to 8 typed fields: strings with lengths, integers and numbers with ranges, booleans, enums,
arrays) and five prompts each (50), asked as chat (the user message in the model's template), each answered under
its schema (``SamplingParams.grammar``), greedy, by every method in one process, interleaved per prompt, after a
warm-up. Also plain decoding without the grammar, to show what the grammar buys. Run:

    python benchmarks/structured_output.py --target ~/.cache/specmesh-bench/smollm2-135m-instruct/hf \\
        --methods none grammar fused grammar:then=fused --limit 50 --json out.json

Reports per method: schema-valid share (the output parses and validates: jsonschema), outputs equal to the
constrained plain decoding's, τ, tokens/s, speedup over ``none`` (median over prompts, and pooled: total tokens
over total time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ENTITIES = {
    "person": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
               "email": {"type": "string", "maxLength": 60}},
    "book": {"title": {"type": "string", "maxLength": 60}, "author": {"type": "string", "maxLength": 40},
             "year": {"type": "integer", "minimum": 1400, "maximum": 2030}, "pages": {"type": "integer", "minimum": 1},
             "genre": {"enum": ["fiction", "science", "history", "poetry", "other"]}},
    "product": {"name": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
                "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                          "maxItems": 4}},
    "city": {"name": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
             "population": {"type": "integer", "minimum": 0}, "capital": {"type": "boolean"},
             "area_km2": {"type": "number", "minimum": 0}, "founded": {"type": "integer"}},
    "movie": {"title": {"type": "string", "maxLength": 60}, "director": {"type": "string", "maxLength": 40},
              "year": {"type": "integer", "minimum": 1880, "maximum": 2030},
              "rating": {"type": "number", "minimum": 0, "maximum": 10},
              "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
              "color": {"type": "boolean"}, "minutes": {"type": "integer", "minimum": 1}},
    "recipe": {"name": {"type": "string", "maxLength": 40}, "servings": {"type": "integer", "minimum": 1},
               "vegetarian": {"type": "boolean"},
               "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 6}},
    "employee": {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 40},
                 "department": {"enum": ["engineering", "sales", "finance", "support"]},
                 "salary": {"type": "number", "minimum": 0}, "manager": {"type": "boolean"},
                 "start_year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                 "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
                 "remote": {"type": "boolean"}},
    "event": {"name": {"type": "string", "maxLength": 50}, "city": {"type": "string", "maxLength": 40},
              "month": {"type": "integer", "minimum": 1, "maximum": 12}, "free": {"type": "boolean"}},
    "car": {"make": {"type": "string", "maxLength": 30}, "model": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "fuel": {"enum": ["petrol", "diesel", "electric", "hybrid"]}, "doors": {"type": "integer", "minimum": 2,
                                                                                   "maximum": 5}},
    "planet": {"name": {"type": "string", "maxLength": 30}, "moons": {"type": "integer", "minimum": 0},
               "radius_km": {"type": "number", "minimum": 0}},
}
SUBJECTS = {
    "person": ["a retired teacher from Lyon", "a young software engineer", "a famous violinist", "a marathon runner",
               "a pastry chef"],
    "book": ["a classic Russian novel", "a popular science book about black holes", "a history of Rome",
             "a collection of haiku", "a detective story"],
    "product": ["a stainless steel water bottle", "a pair of running shoes", "a mechanical keyboard",
                "a cotton t-shirt", "a desk lamp"],
    "city": ["Paris", "Kyoto", "Toronto", "Nairobi", "Buenos Aires"],
    "movie": ["a silent comedy from the 1920s", "a space adventure film", "a romantic drama set in Venice",
              "an animated film about a robot", "a documentary about oceans"],
    "recipe": ["a tomato soup", "pancakes", "a vegetable curry", "a chocolate cake", "a Greek salad"],
    "employee": ["a senior backend developer", "a sales manager", "an accountant", "a support agent on night shifts",
                 "an intern in engineering"],
    "event": ["a jazz festival", "a tech conference", "a marathon", "a book fair", "a food market"],
    "car": ["a small electric city car", "a family station wagon", "a classic sports car", "a pickup truck",
            "a hybrid sedan"],
    "planet": ["Mars", "Jupiter", "Earth", "Neptune", "Venus"],
}


def schema_of(entity: str) -> dict:
    properties = ENTITIES[entity]
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def prompts(limit: int) -> list[tuple[str, dict, str]]:
    """(entity, schema, user message), interleaving the entities so a prefix of the list covers all of them."""
    out = []
    for i in range(5):
        for entity, subjects in SUBJECTS.items():
            schema = schema_of(entity)
            fields = ", ".join(schema["properties"])
            out.append((entity, schema, f"Describe {subjects[i]} as a JSON object with the fields {fields}."))
    return out[:limit]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="a chat model directory (tokenizer.json in it)")
    parser.add_argument("--methods", nargs="+", default=["none", "grammar", "fused", "grammar:then=fused"],
                        help="proposers (NAME or NAME:key=value,...), `none` = constrained plain decoding (the baseline)")
    parser.add_argument("--limit", type=int, default=50, help="prompts (default: all 50)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, default=None, help="write the records and the table here")
    parser.add_argument("--export", type=Path, default=None, metavar="FILE.jsonl",
                        help="write the prompts (messages and schema per line) for benchmarks/vllm_structured.py and "
                             "stop")
    args = parser.parse_args(argv)
    if args.export is not None:
        with args.export.open("w") as f:
            for entity, schema, message in prompts(args.limit):
                f.write(json.dumps({"entity": entity, "schema": schema,
                                    "messages": [{"role": "user", "content": message}]}) + "\n")
        return
    import jsonschema
    from tqdm import tqdm

    from orchestrator.embedded import EmbeddedStack
    from specmesh import models
    from specmesh.chat import ChatTemplate
    from specmesh.sampling import SamplingParams

    models.set_threads(args.threads)
    # every timed run prefills its prompt (each method answers the same prompts), as `specmesh generate` times it
    stack = EmbeddedStack.load(args.target, None, getattr(torch, args.dtype), prefix_caching=False)
    stack.profile_costs = False  # one request at a time: no load to size trees for
    template = ChatTemplate.load(args.target)
    if template is None:
        raise SystemExit(f"{args.target} has no chat template")
    methods = ["none", *[m for m in args.methods if m != "none"]]

    def engine(method: str):
        """A fresh engine on the stack's engine core (the one every command runs) for one request, so no run
        drafts from what an earlier one taught a learning proposer."""
        name, _, options = method.partition(":")
        opts = dict(kv.split("=") for kv in options.split(",")) if options else {}
        return stack.engine(None if name == "none" else name, overlap=False, fresh=True, **opts)

    rows = prompts(args.limit)
    warm = stack.tokenizer.encode(template.render([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    for method in methods:  # warm-up: first forwards, grammar compilation paths
        engine(method).generate(warm, SamplingParams(max_new_tokens=8, grammar=("json_object", "")))
    records = []
    for entity, schema, message in tqdm(rows, desc="prompts", unit="prompt"):
        ids = stack.tokenizer.encode(template.render([{"role": "user", "content": message}]), add_special_tokens=False)
        grammar = ("json_schema", json.dumps(schema))
        for method, sp in [*((m, SamplingParams(max_new_tokens=args.max_new_tokens, grammar=grammar)) for m in methods),
                           ("none (no grammar)", SamplingParams(max_new_tokens=args.max_new_tokens))]:
            method_engine = engine(method.split(" ")[0])  # made before the clock starts: the generation is timed
            started = time.perf_counter()
            result = method_engine.generate(ids, sp)
            seconds = time.perf_counter() - started
            text = stack.decode(result.token_ids)
            try:
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            records.append({"entity": entity, "method": method, "tokens": len(result.token_ids), "seconds": seconds,
                            "tau": result.stats.tau, "valid": valid, "finish": result.finish_reason,
                            "ids": result.token_ids})
    table = []
    base = {r["entity"] + str(i): r for i, r in enumerate(x for x in records if x["method"] == "none")}
    for method in [*methods, "none (no grammar)"]:
        mine = [r for r in records if r["method"] == method]
        speed = [(b["seconds"] / b["tokens"]) / (r["seconds"] / r["tokens"]) for r, b in zip(mine, base.values(),
                                                                                           strict=True)]
        table.append({
            "method": method, "valid": sum(r["valid"] for r in mine) / len(mine),
            "same_as_none": sum(r["ids"] == b["ids"] for r, b in zip(mine, base.values(), strict=True)) / len(mine),
            "tau": sum(r["tokens"] for r in mine) / sum(r["tokens"] / r["tau"] for r in mine),
            "tokens_per_second": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine),
            "speedup_median": statistics.median(speed),
            "speedup_pooled": (sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine))
            / (sum(b["tokens"] for b in base.values()) / sum(b["seconds"] for b in base.values())),
        })
    lines = ["| method | schema-valid | = constrained AR | τ | tok/s | speedup median | pooled |", "|---|---|---|---|---|---|---|"]
    for row in table:
        lines.append(f"| {row['method']} | {row['valid']:.0%} | {row['same_as_none']:.0%} | {row['tau']:.2f} | "
                     f"{row['tokens_per_second']:.1f} | {row['speedup_median']:.2f} | {row['speedup_pooled']:.2f} |")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": vars(args) | {"target": str(args.target), "json": str(args.json)},
                                         "table": table, "records": records}, indent=1))


if __name__ == "__main__":
    main()
