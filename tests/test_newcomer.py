"""A newcomer's path: `serve MODEL` on --host/--port with the OpenAI API alone, a hub id from the local cache
offline, --chat-template, /version, /tokenize, /detokenize, a taken port refused before any model loads."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.http_api import VERSION, build_app
from orchestrator.server import add_arguments, resolve_addresses
from specmesh import models
from specmesh.chat import ChatTemplate, ChatTemplateError
from tests.service_helpers import DRAFT, TARGET, wait_until
from tests.test_http_api import (
    MODEL,
    TEMPLATE,
    AppThread,
    assert_openai_error,
    free_port,
    get,
    http_stack,
    make_service,
    post,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stack():
    yield from http_stack()


def parse(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--command", default="serve")
    args = p.parse_args(argv)
    resolve_addresses(args)
    return args


def test_serve_model_means_embedded_with_http_on_8000_and_no_grpc():
    args = parse("some/model")
    assert (args.embedded, args.target, args.http, args.listen) == (True, "some/model", "127.0.0.1:8000", None)
    args = parse("some/model", "--host", "0.0.0.0", "--port", "9000", "--listen", "127.0.0.1:50051")
    assert (args.http, args.listen) == ("0.0.0.0:9000", "127.0.0.1:50051")
    args = parse("--embedded")  # the long form keeps its gRPC default and no HTTP
    assert (args.http, args.listen) == (None, "127.0.0.1:50050")
    with pytest.raises(SystemExit):
        parse("m", "--http", "127.0.0.1:1", "--port", "2")


def test_served_names():
    assert models.served_name(None) == "demo" and models.served_name(TARGET) == "demo"
    assert models.served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models.served_name(DRAFT) == "draft"


def _fake_hub_cache(root: Path, repo_id: str, source: Path) -> None:
    """The Hugging Face cache layout (models--ORG--NAME/refs/main -> snapshots/<commit>/) holding ``source``."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_resolves_from_the_offline_cache(tmp_path):
    _fake_hub_cache(tmp_path, "tiny-org/demo-target", Path(TARGET))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "specmesh", "generate", "def fibonacci(n):", "--max-new-tokens", "12",
            "--proposer", "none", "--threads", "1"]
    hub = subprocess.run([*argv, "--target", "tiny-org/demo-target"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert hub.returncode == 0, hub.stderr
    local = subprocess.run([*argv, "--target", TARGET], env=env, capture_output=True, text=True, timeout=300)
    assert hub.stdout == local.stdout and hub.stdout.strip()
    missing = subprocess.run([*argv, "--target", "tiny-org/not-cached"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "not in the local Hugging Face cache" in missing.stderr


def test_chat_template_override(tmp_path):
    assert ChatTemplate.load(TARGET) is None  # the demo target has none
    from_string = ChatTemplate.load(TARGET, TEMPLATE)
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    from_file = ChatTemplate.load(TARGET, str(file))
    messages = [{"role": "user", "content": "hi"}]
    assert from_string.render(messages) == from_file.render(messages) == "<|user|>hi\n<|assistant|>"
    with pytest.raises(ChatTemplateError, match="not a readable file"):
        ChatTemplate.load(TARGET, str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate.load(TARGET, "{% for %}")


def test_version_tokenize_detokenize(stack):
    app = AppThread(build_app(make_service(stack), ChatTemplate(TEMPLATE)))
    try:
        assert json.loads(get(app.url + "/version")[1]) == {"version": VERSION}
        status, out = post(app.url + "/tokenize", {"model": MODEL, "prompt": "def f(x):"})
        assert status == 200 and out["tokens"] == stack.tokenizer.encode("def f(x):")
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == stack.target_runner.info.max_positions
        status, chat = post(app.url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and chat["tokens"] == stack.tokenizer.encode("<|user|>hi\n<|assistant|>",
                                                                           add_special_tokens=False)
        status, back = post(app.url + "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
        assert status == 200 and back["prompt"].endswith("def f(x):")
        assert_openai_error(*post(app.url + "/tokenize", {"model": MODEL}), 400)
        assert_openai_error(*post(app.url + "/detokenize", {"tokens": [10 ** 9]}), 400, "tokens")
        assert_openai_error(*post(app.url + "/tokenize", {"model": "other", "prompt": "x"}), 404)
    finally:
        app.stop()


def test_serve_model_answers_the_openai_api_alone(tmp_path):
    port = free_port()
    ready = tmp_path / "ready"
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = subprocess.Popen([sys.executable, "-m", "specmesh", "serve", TARGET, "--port", str(port), "--threads", "1",
                             "--chat-template", str(template), "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 120)
        assert ready.read_text() == str(port)
        url = f"http://127.0.0.1:{port}"
        status, models_list = get(url + "/v1/models")
        assert status == 200 and json.loads(models_list)["data"][0]["id"] == "demo"
        status, answer = post(url + "/v1/chat/completions", {"model": "demo", "max_tokens": 4, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "def f"}]})
        assert status == 200 and answer["choices"][0]["message"]["content"] is not None
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "gRPC" not in out  # no gRPC port unless --listen asks


@pytest.mark.parametrize("flag", ["--listen", "--http"])
def test_a_taken_port_fails_before_any_model_loads(flag):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "specmesh", "serve", "--embedded", flag, address],
                              capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert address in done.stderr and "in use" in done.stderr.lower()
    assert "loading" not in done.stderr.lower() and elapsed < 30  # seconds of imports, not a model load


@pytest.mark.parametrize("argv", [["generate", "--target", "/nonexistent", "x"],
                                  ["generate", "--device", "tpu", "x"],
                                  ["serve", "--embedded", "--target", "/nonexistent"],
                                  ["serve", "/nonexistent"],
                                  ["generate", "--max-new-tokens", "100", "x " * 3000]])  # past the context
def test_argument_and_path_errors_come_before_the_heavy_imports(argv):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "specmesh", *argv], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < 3.0, elapsed  # torch + transformers alone take ~6 s here; the answer needs neither
