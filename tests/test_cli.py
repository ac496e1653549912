"""First contact with the command line: errors are one line and come before any model loads, --help is
light, --json is one object in both modes, servers never share a port by accident, clients wait for a
server that is still starting."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import service_helpers as sh

from specmesh.client import Client

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys
from specmesh_app import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules}))
"""


def run_cli(*args: str, stdin: bytes = b"", timeout: float = 120) -> tuple[int | str, bool, str]:
    """(exit code or SystemExit message, whether torch was loaded, stderr) of `specmesh ARGS` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROBE, *args], input=stdin, capture_output=True, cwd=ROOT,
                         timeout=timeout)
    probe = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return probe["exit"], probe["torch"], out.stderr.decode().strip()


@pytest.mark.parametrize("args,stdin,code,message", [
    (["generate", "x", "--max-nodes", "-3"], b"", 2, "--max-nodes: must be >= 0, got -3"),
    (["generate", "x", "--threads", "0"], b"", 2, "--threads: must be >= 1, got 0"),
    (["generate", "x", "--max-new-tokens", "0"], b"", 2, "--max-new-tokens: must be >= 1"),
    (["generate", "x", "--proposer", "nope"], b"", 2, "invalid choice: 'nope'"),
    (["generate", "x", "--temperature", "-1"], b"", "specmesh generate: temperature must be a finite number >= 0, got -1.0",
     None),
    (["generate", "x", "--temperature", "inf"], b"", "specmesh generate: temperature must be a finite number >= 0, got inf",
     None),
    (["generate", "x", "--temperature", "1", "--top-p", "0"], b"", "specmesh generate: top_p must be in (0, 1], got 0.0",
     None),
    (["generate", "x", "--proposer", "copy", "--members", "copy+retrieval"], b"",
     "specmesh generate: --members is for --proposer fused", None),
    (["generate"], bytes(range(256)) * 8, "specmesh generate: standard input is not UTF-8 text (byte 128)", None),
    (["generate"], b"", "specmesh generate: empty prompt", None),
    (["bogus"], b"", 2, "invalid choice: 'bogus'"),
    (["generate", "x", "--proposer", "mjsd", "--temperature", "0.7"], b"",
     "specmesh generate: proposer mjsd (lossy joint-likelihood acceptance) is greedy only: it needs temperature 0, "
     "got 0.7", None),
    (["generate", "x", "--mjsd-threshold", "0.5"], b"",
     "specmesh generate: an MJSD threshold applies to the mjsd proposer only, not fused", None),
    (["generate", "x", "--proposer", "mjsd", "--mjsd-threshold", "0"], b"",
     "specmesh generate: mjsd_threshold must be a finite number > 0, got 0.0", None),
], ids=["max-nodes", "threads", "max-new-tokens", "proposer", "temperature", "temperature-inf", "top-p", "members",
        "binary-stdin", "empty", "command", "mjsd-sampled", "threshold-without-mjsd", "mjsd-threshold-0"])
def test_bad_arguments_are_one_line_before_any_model_loads(args, stdin, code, message):
    got, torch_loaded, stderr = run_cli(*args, stdin=stdin)
    if message is None:  # a SystemExit whose code is the message itself (printed by Python, exit status 1)
        code, message = 1, code
        assert got == message
    else:
        assert got == code
        assert len(stderr.splitlines()) == 1 and message in stderr, stderr
    assert not torch_loaded


@pytest.mark.parametrize("command", ["", "generate", "bench", "ingest", "verifier", "drafter", "serve"])
def test_help_loads_no_model_stack(command):
    got, torch_loaded, _ = run_cli(*([command] if command else []), "--help")
    assert got == 0 and not torch_loaded


def test_version():
    out = subprocess.run([sys.executable, "-m", "specmesh", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("specmesh ")


def test_a_prompt_past_the_context_is_one_line():
    words = " ".join(["word"] * 20_000)
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", words, "--max-new-tokens", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("specmesh generate: prompt (")
    assert "Traceback" not in out.stderr and "exceeds the target's context" in out.stderr


JSON_KEYS = {"text", "token_ids", "finish_reason", "proposer", "server", "stats"}
STATS_KEYS = {"prompt_tokens", "generated_tokens", "steps", "tau", "tokens_per_second", "total_seconds",
              "acceptance_per_position", "draft_errors", "acceptance", "lossy"}


def _json_run(*extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "def fibonacci(n):", "--max-new-tokens", "12",
                          "--json", "--compare-ar", "--repeats", "2", *extra],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)  # stdout is the JSON object and nothing else
    assert set(doc) == JSON_KEYS | {"compare_ar"} and set(doc["stats"]) == STATS_KEYS
    assert len(doc["token_ids"]) == doc["stats"]["generated_tokens"] == 12 and doc["text"]
    assert doc["compare_ar"]["same_as_ar"] is True and doc["compare_ar"]["repeats"] == 2
    assert doc["compare_ar"]["speedup_min"] <= doc["compare_ar"]["speedup_median"] <= doc["compare_ar"]["speedup_max"]
    return doc


def test_json_is_one_object_with_the_same_schema_in_both_modes(mesh):
    embedded = _json_run("--dtype", "float64")
    remote = _json_run("--server", mesh["serve"].address)
    assert embedded["server"] is None and remote["server"] == mesh["serve"].address
    assert embedded["proposer"] == remote["proposer"] == "fused"  # the measured default
    assert embedded["token_ids"] == remote["token_ids"]  # float64 on both sides: the same greedy tokens


def test_mjsd_runs_on_the_demo_pair_and_says_it_is_lossy():
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "def fibonacci(n):", "--proposer", "mjsd",
                          "--max-new-tokens", "16", "--threads", "1", "--mjsd-threshold", "0.2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "proposer=mjsd" in out.stderr and "lossy (mjsd)" in out.stderr and out.stdout.strip()
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "def f(x):", "--proposer", "mjsd", "--json",
                          "--max-new-tokens", "8", "--threads", "1"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    doc = json.loads(out.stdout)
    assert doc["stats"]["lossy"] is True and doc["stats"]["acceptance"] == "mjsd"


def test_generate_takes_the_request_options(mesh, tmp_path):
    """Structured output and penalties from the command line, embedded and through --server: the same tokens."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False}))
    docs = []
    for extra in ([], ["--server", mesh["serve"].address]):
        out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "def f(x):", "--json-schema", str(schema),
                              "--presence-penalty", "0.5", "--logit-bias", "7=-5", "--max-new-tokens", "16", "--json",
                              "--dtype", "float64", "--threads", "1", *extra], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        docs.append(json.loads(out.stdout))
    assert docs[0]["token_ids"] == docs[1]["token_ids"] and docs[0]["text"].startswith('{"n": ')
    out = subprocess.run([sys.executable, "-m", "specmesh", "generate", "x", "--regex", "a", "--json-object"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "not allowed with" in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drafter_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "specmesh", "drafter", "--draft", "none", "--listen", f"127.0.0.1:{port}"]


def test_a_second_server_on_a_port_in_use_is_refused():
    first = sh.drafter("--draft", "none").wait_ready()
    try:
        out = subprocess.run(_drafter_cmd(first.port), capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1].startswith(f"specmesh drafter: cannot listen on 127.0.0.1:{first.port}")
    finally:
        first.stop()


def test_the_client_waits_for_a_server_still_starting():
    port = _free_port()
    with Client(f"127.0.0.1:{port}") as client:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no server ready"):
            client.wait_ready(0.5)
        assert time.monotonic() - t0 < 5
        ready: list[float] = []
        waiter = threading.Thread(target=lambda: (client.wait_ready(90), ready.append(time.monotonic())))
        waiter.start()
        time.sleep(1.0)  # the client is already waiting when the server starts
        started = time.monotonic()
        proc = subprocess.Popen(_drafter_cmd(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            waiter.join(timeout=100)
            assert ready and ready[0] > started
            assert client.health() == "SERVING"
        finally:
            proc.kill()
            proc.wait(timeout=10)
