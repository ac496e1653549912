"""Streaming text: the time to turn 1,000 generated tokens into streamed text with 4 stop strings, through what
a request runs (``StopChecker``, which searches the stop strings after every token, and ``TextStream``, which
emits the text), against the way both worked before (each decoded the whole output again after every token:
O(n^2) per request; re-implemented here as ``full``, so both run in one process on the same tokens).

The tokens are the tokenizer's encoding of real text (standard-library source from the prompt set), cut to
--tokens; the stop strings never match, so every token is checked. Pushed one token per step (plain decoding)
and 4 per step (a speculative step). Both paths are checked to emit the same text. Usage:

    python benchmarks/detokenize.py --json benchmarks/results/detokenize.json [--tokenizer DIR ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.stopping import StopChecker, TextStream  # noqa: E402
from specmesh.sampling import SamplingParams  # noqa: E402

STOPS = ("\n\n\n\n", "<|endoftext|>", "```\n```", "### END")  # four stop strings that do not occur


class FullStopChecker:
    """The previous StopChecker's stop-string search: decode every generated id after every token."""

    def __init__(self, decode, stops) -> None:
        self.decode, self.stops, self.generated, self.text_len, self.text_limit = decode, stops, [], 0, None

    def push(self, tokens) -> None:
        for tok in tokens:
            self.generated.append(tok)
            text = self.decode(self.generated)
            tail = max(0, self.text_len - max(len(s) for s in self.stops))
            self.text_len = len(text)
            hits = [i for i in (text.find(s, tail) for s in self.stops) if i >= 0]
            if hits:
                self.text_limit = min(hits)
                return


class FullTextStream:
    """The previous TextStream: decode every id pushed so far at every push, emit the stable new part."""

    def __init__(self, decode, stops) -> None:
        self.decode, self.ids, self.printed = decode, [], ""
        self.holdback = max(len(s) for s in stops) - 1

    def push(self, ids) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        text = text[: max(len(self.printed), len(text) - self.holdback)]
        return self._emit(text)

    def flush(self) -> str:
        return self._emit(self.decode(self.ids))

    def _emit(self, text: str) -> str:
        if not text.startswith(self.printed) or text.endswith("\ufffd"):
            return ""
        new, self.printed = text[len(self.printed) :], text
        return new


def stream(kind: str, decode, tokens: list[int], per_step: int) -> tuple[float, str]:
    """(seconds, text) to check and stream ``tokens``, ``per_step`` at a time."""
    t0 = time.perf_counter()
    if kind == "full":
        checker, text = FullStopChecker(decode, STOPS), FullTextStream(decode, STOPS)
        pieces = []
        for i in range(0, len(tokens), per_step):
            checker.push(tokens[i : i + per_step])
            pieces.append(text.push(tokens[i : i + per_step]))
        pieces.append(text.flush())
    else:
        sampling = SamplingParams(max_new_tokens=len(tokens), stop=STOPS, ignore_eos=True)
        checker, text = StopChecker(sampling, (), decode), TextStream(decode, STOPS)
        pieces = []
        for i in range(0, len(tokens), per_step):
            emitted = checker.push(tokens[i : i + per_step])
            pieces.append(text.push(emitted, checker.text_limit))
        pieces.append(text.flush(checker.text_limit))
    return time.perf_counter() - t0, "".join(pieces)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokenizer", nargs="+", type=Path, default=[REPO / "specmesh/demo_models/target"],
                   help="tokenizer directories (Hugging Face)")
    p.add_argument("--prompts", type=Path, default=REPO / "../shared/data/stdlib_continuation.jsonl",
                   help="JSONL whose 'prompt' fields give the text")
    p.add_argument("--tokens", type=int, default=1000, help="tokens streamed per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is reported")
    p.add_argument("--json", type=Path, default=None, help="write the report here (and the table beside it, .md)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    text = "".join(json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip())
    rows = []
    for directory in args.tokenizer:
        tok = AutoTokenizer.from_pretrained(directory)
        tokens = tok(text[: args.tokens * 40], verbose=False).input_ids[: args.tokens]
        if len(tokens) < args.tokens:
            raise SystemExit(f"{args.prompts} gives only {len(tokens)} tokens with {directory}")

        def decode(ids, tok=tok):
            return tok.decode(ids, skip_special_tokens=True)

        for per_step in (1, 4):
            times = {}
            texts = {}
            for kind in ("full", "incremental"):
                runs = [stream(kind, decode, tokens, per_step) for _ in range(args.repeats)]
                times[kind] = min(t for t, _ in runs)
                texts[kind] = runs[0][1]
            if texts["full"] != texts["incremental"] or texts["full"] != decode(tokens):
                raise SystemExit(f"the streamed texts differ ({directory}, {per_step} per step)")
            rows.append({"tokenizer": "/".join(directory.resolve().parts[-2:]),
                         "tokens": len(tokens), "tokens_per_step": per_step, "full_ms": times["full"] * 1e3,
                         "incremental_ms": times["incremental"] * 1e3,
                         "speedup": times["full"] / times["incremental"]})
            print(f"{rows[-1]['tokenizer']}, {per_step}/step: full {times['full'] * 1e3:.1f} ms, incremental "
                  f"{times['incremental'] * 1e3:.1f} ms", file=sys.stderr)
    table = render(rows)
    print(table)
    if args.json:
        report = {"config": {"tokens": args.tokens, "stops": STOPS, "prompts": str(args.prompts),
                             "repeats": args.repeats},
                  "environment": {"python": platform.python_version(), "machine": platform.machine()}, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table + "\n")
    return 0


def render(rows: list[dict]) -> str:
    lines = ["| tokenizer | tokens | per step | before: full decode (ms) | incremental (ms) | speedup |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['tokens']} | {r['tokens_per_step']} | {r['full_ms']:.1f} | "
                     f"{r['incremental_ms']:.1f} | {r['speedup']:.1f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
