"""`specmesh serve` under vLLM's flags (orchestrator/vllm_args.py): what they map onto, what is refused (one line
naming what to use), and a server started with them answering as a vLLM user expects (served names, API key,
--max-model-len, --speculative-config), ready the moment it says so."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from orchestrator.vllm_args import apply_vllm_arguments, parse_speculative_config, served_names
from tests.service_helpers import TARGET, wait_until
from tests.test_http_api import free_port, get, post
from tests.test_newcomer import parse as serve_args


def parse(*argv: str):
    """`serve`'s options as its run() sees them once vLLM's flags are applied."""
    args = serve_args(*argv)
    apply_vllm_arguments(args)
    return args


def refused(*argv: str) -> str:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    message = str(caught.value)
    assert message.startswith("specmesh serve: ") and "\n" not in message
    return message


def test_vllm_names_map_onto_specmesh_options(monkeypatch):
    monkeypatch.delenv("SPECMESH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = parse("some/model", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8", "--enforce-eager",
                 "--no-enable-prefix-caching", "--dtype", "float", "--trust-remote-code")
    assert (args.kv_cache_memory, args.max_concurrent, args.cuda_graphs, args.compile_layers) == (0.5, 8, "off", "off")
    assert args.prefix_caching is False and args.dtype == "float" and args.api_keys == ()
    defaults = parse("some/model")
    assert defaults.kv_cache_memory == parse("--embedded").kv_cache_memory and defaults.max_concurrent == 64
    assert defaults.prefix_caching is True and defaults.cuda_graphs == "auto"
    assert parse("x", "--api-key", "k1", "--api-key", "k2").api_keys == ("k1", "k2")
    assert defaults.tool_parser is None and parse("x", "--enable-auto-tool-choice").tool_parser == "hermes"
    assert parse("x", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json").tool_parser == "llama3_json"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse("x").api_keys == ("from-env",)
    monkeypatch.setenv("SPECMESH_API_KEY", "ours")
    assert parse("x").api_keys == ("ours",) and parse("x", "--api-key", "k").api_keys == ("k",)


def test_served_names_are_the_model_as_given_unless_named():
    assert served_names(parse("./dir/model.gguf"), "model.gguf") == ("./dir/model.gguf",)
    assert served_names(parse("ORG/NAME"), "ORG/NAME") == ("ORG/NAME",)
    assert served_names(parse(str(TARGET)), "demo") == ("demo",)  # the bundled demo target stays `demo`
    assert served_names(parse("x", "--served-model-name", "a", "b", "a"), "x") == ("a", "b")
    assert served_names(parse("x", "--model-name", "m"), "x") == ("m",)
    assert "not both" in refused("x", "--model-name", "m", "--served-model-name", "a")


@pytest.mark.parametrize(("argv", "says"), [
    (["x", "--tensor-parallel-size", "2"], "tensor parallelism is not built yet"),
    (["x", "-tp", "4"], "more verifier replicas"),
    (["x", "--dtype", "half"], "use bfloat16"),
    (["x", "--dtype", "float16"], "use bfloat16"),
    (["x", "--api-key", "has space"], "no whitespace"),
    (["x", "--speculative-config", '{"method": "eagle3", "model": "yuhuili/EAGLE3"}'], "--proposer falcon"),
    (["x", "--speculative-config", '{"method": "suffix"}'], "--proposer copy"),
    (["x", "--speculative-config", '{"method": "ngram", "k": 3}'], "unknown keys k"),
    (["x", "--speculative-config", "{nope"], "not JSON"),
    (["x", "--speculative-config", '{"method": "mjsd"}'], "lossy"),
    (["x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'], ">= 0"),
])
def test_what_is_not_built_is_refused_naming_what_to_use(argv, says):
    assert says in refused(*argv)


def test_speculative_config_becomes_the_default_proposer_and_budget(tmp_path):
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}') \
        == parse_speculative_config('{"method": "prompt_lookup", "max_nodes": 3, "max_depth": 3}')
    spec = parse_speculative_config('{"method": "fused"}')
    assert (spec.proposer, spec.max_nodes, spec.max_depth, spec.draft) == ("fused", None, None, None)
    args = parse("x", "--speculative-config", json.dumps({"model": str(tmp_path), "num_speculative_tokens": 5}))
    assert (args.proposer, args.draft, args.speculative.max_depth) == ("draft_model", tmp_path, 5)
    with pytest.raises(ValueError, match="does not use"):
        parse_speculative_config(json.dumps({"method": "copy", "model": str(tmp_path)}))


def test_a_server_started_with_vllm_flags_answers_as_vllm_does(tmp_path):
    port, ready = free_port(), tmp_path / "ready"
    argv = [sys.executable, "-m", "specmesh", "serve", str(TARGET), "--port", str(port), "--threads", "1",
            "--ready-file", str(ready), "--served-model-name", "coder", "coder-v1", "--api-key", "sk-test",
            "--max-model-len", "96", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 180)
        url = f"http://127.0.0.1:{port}"
        assert get(url + "/health")[0] == 200  # open, and ready: the warm-up ran before the port answered
        key = {"Authorization": "Bearer sk-test"}
        status, listed = get(url + "/v1/models", key)
        assert status == 200 and [m["id"] for m in json.loads(listed)["data"]] == ["coder", "coder-v1"]
        assert all(m["max_model_len"] == 96 for m in json.loads(listed)["data"])
        body = {"model": "coder-v1", "prompt": "def f(x):\n    return x\n\ndef f(x):\n", "max_tokens": 16,
                "temperature": 0}
        assert post(url + "/v1/completions", body)[0] == 401
        timed = time.monotonic()
        status, answer = post(url + "/v1/completions", body, key)
        first_request = time.monotonic() - timed
        assert status == 200, answer
        assert answer["model"] == "coder" and answer["specmesh"]["proposer"] == "prompt_lookup"
        assert answer["specmesh"]["max_depth"] == 3
        status, again = post(url + "/v1/completions", body, key)
        assert status == 200 and again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert first_request < 10.0, f"the first request took {first_request:.1f} s after {time.monotonic() - started:.0f}"
        status, error = post(url + "/v1/completions", {**body, "max_tokens": 90}, key)  # past --max-model-len
        assert status == 400 and "96" in error["error"]["message"]
        assert post(url + "/v1/completions", {**body, "model": "other"}, key)[0] == 404
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "warmed up" in out


def test_log_format_json_writes_one_object_per_line(tmp_path):
    port, ready = free_port(), tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "specmesh", "serve", str(TARGET), "--port", str(port),
                             "--threads", "1", "--ready-file", str(ready), "--log-format", "json", "--access-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 180)
        assert get(f"http://127.0.0.1:{port}/livez")[0] == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"] == "specmesh.serve" and "warmed up" in r["message"] for r in records)
    assert any(r["logger"] == "uvicorn.access" and "/livez" in r["message"] for r in records)


def test_livez_answers_while_the_model_loads_and_health_only_once_warm(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specmesh", "serve", str(TARGET), "--port", str(port),
                             "--threads", "1", "--ready-file", str(tmp_path / "ready")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def status(path: str) -> int:
        try:
            return get(url + path)[0]
        except OSError:  # not bound yet
            return 0

    try:
        assert wait_until(lambda: status("/livez") == 200 or proc.poll() is not None, 120, 0.02)
        loading = not (tmp_path / "ready").exists()  # answered before the server said it was ready
        health = status("/health")
        assert wait_until(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, 180)
        assert get(url + "/health")[0] == 200 and get(url + "/livez")[0] == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert loading and health == 503, (loading, health)  # alive while loading, not ready
