"""The README's examples run as pasted: the first-run command, and the OpenAI API section's server, curl and
Python blocks (on a free port instead of 8000), so the served model id and the examples cannot drift apart."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.service_helpers import wait_until
from tests.test_http_api import free_port, get

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks between ``heading`` and the next heading of any level."""
    text = README.read_text()
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
    blocks = section_blocks("### OpenAI-compatible HTTP API")
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
