"""The documented examples run as pasted, and the documented command lines are real ones.

- The README's first-run command, and the OpenAI API page's server, curl and Python blocks (on a free port
  instead of 8000), so the served model id and the examples cannot drift apart.
- Every `specmesh COMMAND ...` line of a ```bash block in the README and docs/*.md names a real command and only
  options that command's parser accepts (parsed by the CLI's own parser; no model runs). Placeholders (MODEL,
  FILE.jsonl, DIR, $VARIABLES) parse as the strings they are; a bare ``...`` elides options.
- docs/cli.md's index of `serve`'s options lists each of them, and nothing else."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.service_helpers import wait_until
from tests.test_http_api import free_port, get

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HTTP_API = ROOT / "docs" / "http-api.md"
CLI = ROOT / "docs" / "cli.md"
DOCUMENTED = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(bash|python)\n(.*?)```", re.S)
ELISION = "..."


def section_blocks(page: Path, heading: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks between ``heading`` and the next heading of any level."""
    text = page.read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return FENCE.findall(text[start:end if end != -1 else None])


def commands(code: str) -> list[str]:
    """A bash block's commands, continuation lines joined and comments dropped."""
    joined = code.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def test_the_first_run_line_works():
    blocks = [code for lang, code in FENCE.findall(README.read_text()) if lang == "bash"]
    run = next(c for c in commands(blocks[0]) if c.startswith("specmesh generate"))
    argv = [sys.executable, "-m", "specmesh", *shlex.split(run)[1:], "--max-new-tokens", "8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_the_openai_api_examples_work_as_pasted():
    blocks = section_blocks(HTTP_API, "# OpenAI-compatible HTTP API")
    shell = commands(next(code for lang, code in blocks if lang == "bash"))
    python = next(code for lang, code in blocks if lang == "python")
    serve, curls = shell[0], [c for c in shell[1:] if c.startswith("curl")]
    assert serve.startswith("specmesh serve") and curls
    port = str(free_port())

    def here(text: str) -> str:
        return text.replace(":8000", f":{port}")

    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        argv = [sys.executable, "-m", "specmesh", *shlex.split(here(serve))[1:], "--listen", "127.0.0.1:0",
                "--threads", "1", "--ready-file", str(ready)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert wait_until(lambda: ready.exists() or proc.poll() is not None, 120)
            assert proc.poll() is None, proc.stdout.read()
            assert wait_until(lambda: get(f"http://127.0.0.1:{port}/health")[0] == 200, 30)
            for curl in curls:
                out = subprocess.run(["bash", "-c", here(curl)], capture_output=True, text=True, timeout=120)
                assert out.returncode == 0 and '"choices"' in out.stdout, (curl, out.stdout, out.stderr)
                assert '"error"' not in out.stdout, out.stdout
            done = subprocess.run([sys.executable, "-c", here(python)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), done.stderr
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail("serve did not stop on SIGTERM")


# ------------------------------------------------------------------ the documented command lines
def specmesh_lines(page: Path) -> list[list[str]]:
    """argv (after ``specmesh``) of every `specmesh ...` command in the page's bash blocks: a line's commands
    split at shell operators (``&``, ``&&``, ``;``, ``|``, ``$(``), leading VAR=value assignments dropped."""
    found = []
    for lang, code in FENCE.findall(page.read_text()):
        if lang != "bash":
            continue
        for line in commands(code):
            if not re.search(r"(^|[\s;&|(])specmesh\s", line):
                continue  # (a line of another program's, maybe quoted across lines, as the README's curl)
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, ""
            segment: list[str] = []
            for token in [*lexer, ";"]:
                if set(token) <= set("();<>|&"):
                    while segment and re.fullmatch(r"[A-Za-z_]\w*=.*", segment[0]):
                        segment.pop(0)
                    if segment and segment[0] == "specmesh":
                        found.append(segment[1:])
                    segment = []
                else:
                    segment.append(token)
    return found


def parse_line(argv: list[str]) -> str | None:
    """None when the CLI's parser takes ``argv`` as `specmesh` would (serve: with vLLM's flags translated and its
    addresses resolved, as `serve` does before loading anything); else what is wrong."""
    from orchestrator.server import resolve_addresses
    from orchestrator.vllm_args import apply_vllm_arguments
    from specmesh_app.cli import COMMANDS, build_parser

    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        return f"no command {command!r} (commands: {', '.join(COMMANDS)})"
    if any(a in ("-h", "--help", "--version") for a in argv):
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, extra = build_parser([command]).parse_known_args(argv)
            if command == "serve":
                apply_vllm_arguments(args)
                resolve_addresses(args)
    except SystemExit as exc:
        return f"{err.getvalue().strip() or exc}"
    unknown = [a for a in extra if a != ELISION]
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def test_every_documented_command_line_parses():
    lines = [(page, argv) for page in DOCUMENTED for argv in specmesh_lines(page)]
    assert len(lines) >= 20 and {argv[0] for _, argv in lines} >= {"generate", "bench", "serve", "verifier",
                                                                   "drafter", "ingest", "train-falcon"}
    wrong = [f"{page.relative_to(ROOT)}: specmesh {shlex.join(argv)}: {problem}"
             for page, argv in lines if (problem := parse_line(argv)) is not None]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_command_line_is_caught():
    assert parse_line(["generate", "x", "--no-such-option"]) is not None
    assert parse_line(["serve", "--embedded", "--http", "--device", "cpu"]) is not None  # --http takes HOST:PORT
    assert parse_line(["no-such-command"]) is not None
    assert parse_line(["verifier", ELISION]) is None


def serve_options() -> set[str]:
    from specmesh_app.cli import build_parser

    parser = build_parser(["serve"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {o for action in sub._actions for o in action.option_strings} - {"-h", "--help"}


def test_the_cli_page_indexes_every_serve_option():
    text = CLI.read_text()
    start = text.index("## `specmesh serve [MODEL]`")
    section = text[start:text.index("\n## ", start + 1)]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    indexed = {o for row in rows for o in re.findall(r"`(-{1,2}[a-z][\w-]*)", row)}
    assert indexed == serve_options(), (sorted(serve_options() - indexed), sorted(indexed - serve_options()))
