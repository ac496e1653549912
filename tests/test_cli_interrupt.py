"""A newcomer's first minutes with `specmesh generate`: Ctrl-C ends it with the stats so far and no traceback,
no prompt on a terminal is a usage line (not a silent wait), a draft that cannot work with the target is one
line before any weights load, and what --compare-ar times is like with like."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmesh import models
from tests.test_cli import PROBE  # cli.main in a child: its exit code and whether torch was imported

ROOT = Path(__file__).resolve().parents[1]
TARGET = models.demo_model("target")


def _sigint_as_a_terminal_gives_it() -> None:
    # a shell without job control starts background jobs (`.ci/run &`, nohup) with SIGINT ignored, and children
    # inherit that: Python then never raises KeyboardInterrupt. A user's terminal delivers it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, **kwargs) -> subprocess.Popen:
    """`python -m specmesh ARGS`, the program as a user starts it (from a terminal: SIGINT delivered)."""
    return subprocess.Popen([sys.executable, "-m", "specmesh", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_sigint_as_a_terminal_gives_it, **kwargs)


def first_output(proc: subprocess.Popen, timeout: float) -> bytes:
    """Read stdout until its first non-blank bytes arrive (what a user sees first)."""
    os.set_blocking(proc.stdout.fileno(), False)
    got, deadline = b"", time.monotonic() + timeout
    while not got.strip():
        assert time.monotonic() < deadline, "no output in time"
        assert proc.poll() is None, f"exited early: {proc.returncode} {proc.stderr.read().decode()}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            got += proc.stdout.read() or b""
    return got


def interrupt(proc: subprocess.Popen, within: float = 20) -> tuple[bytes, str, float]:
    """SIGINT (what Ctrl-C sends); (the rest of stdout, stderr, seconds it took to exit)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {within} s after SIGINT")
    return out or b"", err.decode(), time.monotonic() - start


def test_ctrl_c_mid_generation_prints_the_stats_so_far_and_exits_130():
    # plain decoding of 2000 tokens: seconds of generation on any CPU, so the signal lands mid-run
    proc = spawn("generate", "def f(x):", "--proposer", "none", "--max-new-tokens", "2000", "--ignore-eos")
    try:
        shown = first_output(proc, timeout=180)
        rest, err, seconds = interrupt(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("[specmesh] proposer=none tokens=") and "finish=interrupted" in err, err
    generated = int(err.split("tokens=")[1].split()[0])
    assert 0 < generated < 2000
    assert (shown + rest).endswith(b"\n")  # the streamed text stays, and the stats line starts a line of its own
    assert seconds < 10


@pytest.mark.parametrize("delay", [0.2, 0.7, 1.2])
def test_ctrl_c_while_starting_or_loading_is_one_line(delay):
    """Wherever it lands (importing torch, loading the models, warming up), one line and status 130."""
    proc = spawn("generate", "def f(x):", "--proposer", "none", "--max-new-tokens", "2000", "--ignore-eos")
    try:
        time.sleep(delay)
        _, err, seconds = interrupt(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.strip() in ("specmesh: interrupted", "specmesh generate: interrupted") or "finish=interrupted" in err
    assert seconds < 10


def test_no_prompt_on_a_terminal_is_a_usage_line_at_once():
    controller, terminal = pty.openpty()  # stdin is a terminal, and nobody types
    try:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", PROBE, "generate"], stdin=terminal, capture_output=True,
                             cwd=ROOT, timeout=30)
        seconds = time.monotonic() - start
    finally:
        os.close(controller)
        os.close(terminal)
    probe = json.loads(out.stdout.decode().strip().splitlines()[-1])
    stderr = out.stderr.decode().strip()
    assert probe == {"exit": 2, "torch": False}  # no model stack loaded
    assert stderr.splitlines() == ["specmesh generate: give a PROMPT argument or pipe one on standard input "
                                   "(see specmesh generate --help)"]
    assert seconds < 10


def _config_only_draft(path: Path, vocab_size: int) -> Path:
    """A draft directory with a config and the target's tokenizer but no weights: refusing it from the config
    is the only way to answer before loading weights."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET / name, path / name)
    return path


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_a_draft_of_another_vocabulary_is_one_line_before_any_weights_load(tmp_path, command):
    draft = _config_only_draft(tmp_path / "draft", vocab_size=1000)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f(x):"}\n')
    argv = {"generate": ["generate", "def f(x):", "--max-new-tokens", "4"],
            "serve": ["serve", "--embedded", "--listen", "127.0.0.1:0"],
            "bench": ["bench", "--prompts", str(prompts), "--json", str(tmp_path / "out.json")]}[command]
    out = subprocess.run([sys.executable, "-m", "specmesh", *argv, "--draft", str(draft)], capture_output=True,
                         cwd=ROOT, timeout=120)
    stderr = out.stderr.decode().strip()
    assert out.returncode == 1
    assert stderr.splitlines() == [f"specmesh {command}: the draft's vocabulary has 1000 tokens, the target's 4096: "
                                   "a draft model must share the target's tokenizer"]


def test_a_draft_without_a_tokenizer_is_one_line(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(models.demo_model("draft"), draft)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).unlink()
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "x", "--draft", str(draft)],
                         capture_output=True, cwd=ROOT, timeout=120)
    stderr = out.stderr.decode().strip()
    assert out.returncode == 1 and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"specmesh generate: no tokenizer could be loaded from the draft model's directory {draft}")


def test_every_run_drafts_with_a_fresh_proposer():
    """--compare-ar times the method as it ran when shown: a learning proposer (fused's retrieval member) does
    not draft the later runs from the earlier runs' output, which would flatter the speedup."""
    from specmesh.sampling import SamplingParams
    from specmesh_app import cli

    args = cli.build_parser(["generate"]).parse_args(["generate", "def f(x):", "--compare-ar", "--threads", "1"])
    sampling = SamplingParams(max_new_tokens=48, ignore_eos=True)
    run = cli._embedded_runs(args, args.prompt, sampling, "fused")
    first, second, ar = run("fused", echo=False), run("fused", echo=False), run("none", echo=False)
    assert first.token_ids == second.token_ids == ar.token_ids  # greedy: the target's own output
    assert (second.stats["steps"], second.stats["tau"]) == (first.stats["steps"], first.stats["tau"])
