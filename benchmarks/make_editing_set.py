"""Build benchmarks/data/editing.jsonl: editing and multi-turn requests over real Python functions.

The workload suffix decoding is for: the model re-emits code it was given with a small change. Each function of
``../shared/data/stdlib_functions.jsonl`` (the signature and docstring ending its prompt, plus the reference
body) becomes four requests:

- ``hints``: rewrite the function with type hints;
- ``rename``: rename one of its parameters everywhere;
- ``docstring``: the function without its docstring, to be given one;
- ``turns``: a conversation (``messages``, for ``bench --chat``): the function, a rename asked for, the renamed
  function as the assistant's answer, then "now add type hints": the answer is sent back with a change request.

Every row also has ``prompt``, the same request as one raw text (an instruction, the code, an opened code block),
what ``bench`` sends without ``--chat``. Output quality does not matter for speed; the copy-heavy shape does.

    python benchmarks/make_editing_set.py            # writes benchmarks/data/editing.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "stdlib_functions.jsonl"
OUT = ROOT / "benchmarks" / "data" / "editing.jsonl"
MAX_NEW_TOKENS = 256
REPLY = "Reply with the whole function in one Python code block and nothing else."


def function_text(row: dict) -> str | None:
    """The function a stdlib row ends with: its last ``def`` line onwards, plus the reference body, dedented."""
    lines = row["prompt"].splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*(async\s+)?def ", line)]
    if not starts:
        return None
    body = "\n".join(lines[starts[-1] :]) + "\n" + row["reference"]
    return textwrap.dedent(body).strip("\n") + "\n"


def parameter(code: str) -> str | None:
    """A parameter worth renaming: the first that is not self/cls and is used in the body."""
    match = re.match(r"\s*(?:async\s+)?def \w+\((.*?)\)\s*(?:->.*)?:", code, re.S)
    if not match:
        return None
    names = [re.split(r"[=:]", p)[0].strip().lstrip("*") for p in match.group(1).split(",")]
    body = code[match.end() :]
    return next((n for n in names if n and n not in ("self", "cls") and re.search(rf"(?<!\.)\b{re.escape(n)}\b", body)), None)


def rename(code: str, old: str, new: str) -> str:
    """Every use of the name ``old``, not attributes of that name (``self.old`` stays)."""
    return re.sub(rf"(?<!\.)\b{re.escape(old)}\b", new, code)


def without_docstring(code: str) -> str:
    return re.sub(r'(:\n)(\s+)("""|\'\'\')(.*?)\3\n', r"\1", code, count=1, flags=re.S)


def raw(instruction: str, code: str) -> str:
    return f"# {instruction}\n\n```python\n{code}```\n\n```python\n"


def rows_for(fid: str, code: str) -> list[dict]:
    name = parameter(code)
    if name is None:
        return []
    new = f"{name}_value"
    block = f"```python\n{code}```"
    hints = f"Rewrite this Python function with type hints on every parameter and on the return value. {REPLY}"
    renamed = f"In this Python function, rename the parameter `{name}` to `{new}` everywhere. {REPLY}"
    bare = without_docstring(code)
    doc = f"Add a docstring to this Python function that says what it does and what it returns. {REPLY}"
    follow = f"Now also add type hints to every parameter and the return value. {REPLY}"
    turns = [
        {"role": "user", "content": f"{renamed}\n\n{block}"},
        {"role": "assistant", "content": f"```python\n{rename(code, name, new)}```"},
        {"role": "user", "content": follow},
    ]
    flat = (f"# {renamed}\n\n```python\n{code}```\n\n```python\n{rename(code, name, new)}```\n\n# {follow}\n\n"
            "```python\n")
    common = {"max_new_tokens": MAX_NEW_TOKENS, "source": fid}
    return [
        {"id": f"{fid}-hints", "task": "hints", "prompt": raw(hints, code),
         "messages": [{"role": "user", "content": f"{hints}\n\n{block}"}], **common},
        {"id": f"{fid}-rename", "task": "rename", "prompt": raw(renamed, code),
         "messages": [{"role": "user", "content": f"{renamed}\n\n{block}"}], **common},
        {"id": f"{fid}-docstring", "task": "docstring", "prompt": raw(doc, bare),
         "messages": [{"role": "user", "content": f"{doc}\n\n```python\n{bare}```"}], **common},
        {"id": f"{fid}-turns", "task": "turns", "prompt": flat, "messages": turns, **common},
    ]


def build(source: Path, functions: int, max_lines: int) -> list[dict]:
    """Four requests for each of the first ``functions`` functions of at most ``max_lines`` lines, a function's
    four together (so ``bench --limit 4k`` keeps the mix of tasks)."""
    per_function = []
    for line in source.read_text().splitlines():
        row = json.loads(line)
        code = function_text(row)
        if code is None or len(code.splitlines()) > max_lines:
            continue
        made = rows_for(row["id"].replace("stdlib_functions", "editing"), code)
        if made:
            per_function.append(made)
        if len(per_function) == functions:
            break
    return [row for rows in per_function for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="stdlib functions JSONL (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: %(default)s)")
    parser.add_argument("--functions", type=int, default=16, help="functions to use (default: %(default)s)")
    parser.add_argument("--max-lines", type=int, default=40, help="longest function taken (default: %(default)s)")
    args = parser.parse_args()
    rows = build(args.source, args.functions, args.max_lines)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} requests from {len(rows) // 4} functions -> {args.out}")


if __name__ == "__main__":
    main()
