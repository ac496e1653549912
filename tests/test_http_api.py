"""The OpenAI-compatible HTTP API: the official `openai` client, raw HTTP and curl against real servers.

Most tests run the app in this process (uvicorn on a thread, an embedded stack of the bundled demo pair in
float64, so greedy outputs can be compared with the engine's token for token); the last ones start
`specmesh serve` as real processes, embedded and over a verifier replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http.client
import json
import logging
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch

from orchestrator import http_api
from orchestrator.embedded import MAX_WINDOW_ROWS, EmbeddedBackend, EmbeddedStack
from orchestrator.engine import GenerationResult
from orchestrator.http_server import HttpLimits, HttpServer, TlsFiles, bind
from orchestrator.service import GenerationService
from orchestrator.stats import RequestStats
from specmesh.chat import ChatTemplate
from specmesh.client import Client
from specmesh.sampling import SamplingParams
from specmesh_app.local_mesh import ServiceProcess
from tests.service_helpers import DRAFT, TARGET, start_all, verifier, wait_until

MODEL = "demo-target"
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class AppThread:
    """The HTTP server of `specmesh serve --http` serving an app on 127.0.0.1 from a thread of this process,
    until ``stop`` (at once) or ``drain`` (as SIGTERM does)."""

    def __init__(self, app, limits: HttpLimits | None = None, tls: TlsFiles | None = None,
                 access_log: bool = False) -> None:
        sock = bind("127.0.0.1:0")
        self.server = HttpServer(app, sock, limits or HttpLimits(), tls, in_flight=lambda: app.state.api.in_flight,
                                 on_drain=app.state.api.drain, access_log=access_log, on_cut=app.state.api.cut)
        self.port = sock.getsockname()[1]
        self.url = self.server.url
        self._loop = asyncio.new_event_loop()
        self._task = None
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._task = self._loop.create_task(self.server.run())
            self._loop.call_soon(started.set)
            try:
                self._loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        assert started.wait(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def drain(self, grace: float) -> concurrent.futures.Future:
        """Start draining (as SIGTERM does); the future is done when the server has stopped."""
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace), self._loop)


def http_stack():
    """The demo pair in float64 with a small KV pool, closed after the module (the HTTP tests' fixtures)."""
    stack = EmbeddedStack.load(TARGET, DRAFT, torch.float64, kv_cache_gb=0.05)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def stack():
    yield from http_stack()


def make_service(stack, **kw) -> GenerationService:
    kw.setdefault("default_proposer", "draft_model")
    return GenerationService(EmbeddedBackend(stack), stack.tokenizer, MODEL, **kw)


@pytest.fixture(scope="module")
def server(stack):
    service = make_service(stack)
    app = AppThread(http_api.build_app(service, ChatTemplate(TEMPLATE, {"eos_token": "<|endoftext|>"})))
    yield service, app
    app.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(stack, prompt: str, max_new_tokens: int) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of plain greedy decoding on the engine."""
    ids = stack.tokenizer.encode(prompt)
    result = stack.engine(None).generate(ids, SamplingParams(max_new_tokens=max_new_tokens))
    return stack.decode(result.token_ids), result.token_ids, result.finish_reason


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def assert_openai_error(status: int, body: dict, expected: int, param: str | None = None) -> None:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


# ------------------------------------------------------------------------------------------ openai client
@pytest.mark.parametrize("proposer", ["none", "prompt_lookup", "draft_model", "fused"])
def test_completions_greedy_equal_the_engine_for_every_proposer(stack, client, proposer):
    for prompt in PROMPTS:
        text, ids, finish = reference(stack, prompt, 24)
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={"proposer": proposer})
        choice = response.choices[0]
        assert choice.text == text and choice.finish_reason == finish
        assert response.usage.prompt_tokens == len(stack.tokenizer.encode(prompt))
        assert response.usage.completion_tokens == len(ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + len(ids)
        ext = response.model_extra["specmesh"]
        assert ext["proposer"] == proposer
        steps = ext["steps"]
        assert 1 <= steps <= len(ids) - 1 and ext["tau"] == pytest.approx((len(ids) - 1) / steps, abs=1.01)
        assert len(ext["acceptance_per_position"]) == len(ext["accepted_per_position"])
        if proposer == "none":
            assert ext["tau"] == 1.0 and ext["accepted_per_position"] == []


@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft_model", "fused"])
def test_penalties_and_logit_bias_change_the_output_and_speculation_keeps_it(stack, client, proposer):
    """OpenAI's presence/frequency penalties, logit_bias and vLLM's repetition_penalty: the engine's plain decoding
    with the same options, token for token (chat and completions)."""
    bias_token = stack.tokenizer.encode(" return")[-1]
    options = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {str(bias_token): 3.0}}
    extra = {"repetition_penalty": 1.3}
    ids = stack.tokenizer.encode(PROMPTS[1])
    sampling = SamplingParams(max_new_tokens=24, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                              logit_bias=((bias_token, 3.0),))
    expected = stack.decode(stack.engine(None).generate(ids, sampling).token_ids)
    assert expected != reference(stack, PROMPTS[1], 24)[0]  # the options matter on this prompt
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, **options,
                                         extra_body={"proposer": proposer, **extra})
    assert response.choices[0].text == expected
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, **options, extra_body={"proposer": proposer, **extra})
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=0, **options, extra_body={"proposer": "none", **extra})
    assert chat.choices[0].message.content == plain.choices[0].message.content


def test_completions_logprobs_streamed_and_not(stack, client):
    """OpenAI's completions ``logprobs``: one entry per generated token, the same numbers with and without
    speculation, the tokens' texts joining into the text, streamed pieces adding up to the whole."""
    ask = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2)
    plain = client.completions.create(**ask, extra_body={"proposer": "none"}).choices[0]
    spec = client.completions.create(**ask, extra_body={"proposer": "draft_model"}).choices[0]
    assert spec.text == plain.text
    lp, ref = spec.logprobs, plain.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    assert "".join(lp.tokens) == spec.text and lp.tokens == ref.tokens
    assert lp.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(value)  # greedy: the best
        assert top.get(token, value) == pytest.approx(value)
    pieces = list(client.completions.create(**ask, stream=True, extra_body={"proposer": "draft_model"}))
    streamed = [t for p in pieces if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.tokens]
    values = [v for p in pieces if p.choices and p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs]
    offsets = [o for p in pieces if p.choices and p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-4) and offsets == lp.text_offset
    no = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert no.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}], max_tokens=12, temperature=0.8,
               seed=3, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask, extra_body={"proposer": "draft_model"}).choices[0]
    content = whole.logprobs.content
    assert len(content) == 12 and "".join(c.token for c in content) == whole.message.content
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        assert c.logprob <= 0 and all(t.logprob >= -9999.0 for t in c.top_logprobs)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    pieces = list(client.chat.completions.create(**ask, stream=True, extra_body={"proposer": "draft_model"}))
    streamed = [c for p in pieces if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]  # seeded: the same tokens and numbers
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    only = client.chat.completions.create(**{**ask, "top_logprobs": None}).choices[0].logprobs.content
    assert all(c.top_logprobs == [] for c in only)


def test_n_choices_are_independent_requests_streamed_with_their_indices(stack, client, server):
    """n > 1: each choice a request of its own (a seeded one samples choice i with seed + i), sharing the prompt's
    prefill through the prefix cache; streamed, every chunk says its choice's index. Greedy choices are the greedy
    output; sampled ones differ (a seeded run's exact tokens also depend on its drafting deadlines under load)."""
    ask = dict(model=MODEL, prompt=PROMPTS[1] * 3, max_tokens=12, temperature=0,
               extra_body={"proposer": "draft_model"})
    client.completions.create(**{**ask, "prompt": PROMPTS[0]})  # the engine core exists from here on
    verifier = server[0].backend.stack.shared_verifiers()[0].scheduler.verifier
    hits = verifier.allocator.hits
    many = client.completions.create(n=3, **ask)
    assert verifier.allocator.hits > hits  # the later choices found the first's prompt blocks
    text, ids, finish = reference(stack, PROMPTS[1] * 3, 12)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(c.text == text and c.finish_reason == finish for c in many.choices)
    assert many.usage.prompt_tokens == len(stack.tokenizer.encode(PROMPTS[1] * 3))
    assert many.usage.completion_tokens == 3 * len(ids)
    assert len(many.model_extra["specmesh"]["choices"]) == 3
    pieces = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask))
    texts = ["", "", ""]
    for piece in pieces:
        for choice in piece.choices:
            texts[choice.index] += choice.text
    assert texts == [text] * 3
    assert sorted(c.index for p in pieces for c in p.choices if c.finish_reason) == [0, 1, 2]
    assert pieces[-1].usage.completion_tokens == 3 * len(ids)
    plain = {**ask, "temperature": 1.0, "seed": 5, "extra_body": {"proposer": "none"}}  # a seed repeats
    sampled = client.completions.create(n=4, **plain)
    assert len({c.text for c in sampled.choices}) > 1
    for i, choice in enumerate(sampled.choices):  # choice i is the request seeded with 5 + i
        assert choice.text == client.completions.create(**{**plain, "seed": 5 + i}).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                          n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=6, n=2, temperature=0, stream=True))
    for index in (0, 1):
        assert "".join(c.delta.content or "" for p in streamed for c in p.choices if c.index == index) == \
            chat.choices[0].message.content


def test_best_of_returns_the_most_likely_candidates(client):
    """best_of candidates ranked by the sum of their tokens' log-probabilities; the n best come back."""
    ask = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=11,
               extra_body={"proposer": "none"})  # plain decoding: a seed repeats whatever the load
    candidates = client.completions.create(n=4, logprobs=0, **ask).choices
    scores = sorted((sum(c.logprobs.token_logprobs), c.text) for c in candidates)
    best = client.completions.create(n=2, best_of=4, **ask).choices
    assert [c.text for c in best] == [t for _, t in scores[::-1][:2]]
    assert all(c.logprobs is None for c in best)  # ranked by logprobs the client did not ask for


def test_structured_output_response_format_and_guided_fields(stack, client):
    """response_format json_schema / json_object and vLLM's guided_* fields: the output follows the grammar, the
    same with and without speculation; malformed or doubled requests are a 400."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    messages = [{"role": "user", "content": "a record"}]
    texts = set()
    for proposer in ("none", "grammar", "draft_model", "fused"):
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                              response_format=fmt, extra_body={"proposer": proposer})
        if chat.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        texts.add(chat.choices[0].message.content)
        assert chat.choices[0].message.content.startswith('{"name": "')
    assert len(texts) == 1  # greedy: the constrained output, whatever drafts
    obj = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, seed=1,
                                       extra_body={"guided_choice": ["alpha", "beta gamma"]})
    assert choice.choices[0].text in ("alpha", "beta gamma") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                   response_format=fmt, stream=True))
    assert "".join(c.delta.content or "" for p in streamed for c in p.choices) == texts.pop()
    url = client.base_url.join("completions")
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    assert_openai_error(*post(str(url), {**ok, "response_format": {"type": "xml"}}), 400, "response_format")
    assert_openai_error(*post(str(url), {**ok, "response_format": {"type": "json_schema"}}), 400, "response_format")
    assert_openai_error(*post(str(url), {**ok, "guided_regex": "(unclosed"}), 400)
    assert_openai_error(*post(str(url), {**ok, "guided_regex": "a", "guided_choice": ["b"]}), 400)


def test_mjsd_is_asked_for_by_name_greedy_only_and_reported_lossy(stack, client, server):
    """The lossy proposer: its stats say so; with OpenAI's default temperature (1) it is a clear 400."""
    prompt = PROMPTS[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"proposer": "mjsd", "mjsd_threshold": 0.2})
    ext = response.model_extra["specmesh"]
    assert ext["proposer"] == "mjsd" and ext["lossy"] is True and ext["acceptance"] == "mjsd"
    sampling = SamplingParams(max_new_tokens=16, acceptance="mjsd", mjsd_threshold=0.2)
    ids = stack.engine("mjsd").generate(stack.tokenizer.encode(prompt), sampling).token_ids
    assert response.choices[0].text == stack.decode(ids)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert plain.model_extra["specmesh"]["lossy"] is False
    status, body = post(server[1].url + "/v1/completions", {"model": MODEL, "prompt": prompt, "proposer": "mjsd"})
    assert_openai_error(status, body, 400)
    assert "greedy only" in body["error"]["message"]


def test_streaming_completions_carry_the_same_text_usage_and_stats(stack, client):
    prompt = PROMPTS[1]
    text, ids, _ = reference(stack, prompt, 40)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].model_extra["specmesh"]["steps"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert len({c.id for c in chunks}) == 1
    # without include_usage: no usage chunk
    plain = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert all(c.choices for c in plain)


def test_stop_strings_echo_and_token_prompts(stack, client):
    text, _, _ = reference(stack, PROMPTS[0], 32)
    stop = text[5:8]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=stop,
                                         stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == kept.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPTS[0]) and echoed.choices[0].text[len(PROMPTS[0]):] == \
        reference(stack, PROMPTS[0], 8)[0]
    ids = stack.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == reference(stack, PROMPTS[0], 8)[0]


def test_chat_renders_the_template_and_streams(stack, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = ChatTemplate(TEMPLATE).render(messages)
    ids = stack.tokenizer.encode(rendered, add_special_tokens=False)
    expected = stack.decode(stack.engine(None).generate(ids, SamplingParams(max_new_tokens=16)).token_ids)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_chat_without_a_template_is_a_clear_400(stack):
    app = AppThread(http_api.build_app(make_service(stack), None))
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    finally:
        app.stop()


def test_one_log_line_per_request_with_the_id_the_client_sees(stack, client, caplog):
    """Every finished request logs one logfmt line on specmesh.requests: the response's id, its finish reason,
    token counts, parameters and proposer; a client that went away mid-stream logs ``aborted``; a service
    built with log_requests=False logs nothing."""
    caplog.set_level(logging.INFO, logger="specmesh.requests")
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"proposer": "prompt_lookup"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          stream=True, temperature=0.5, seed=3)
    chat_id = next(iter(chat)).id
    for _ in chat:
        pass
    lines = {r.getMessage().split()[0]: r.getMessage() for r in caplog.records if r.name == "specmesh.requests"}
    assert set(lines) == {f"id={out.id}", f"id={chat_id}"}, lines
    fields = dict(part.split("=", 1) for part in lines[f"id={out.id}"].split())
    assert fields["op"] == "text_completion" and fields["finish"] == out.choices[0].finish_reason
    assert int(fields["prompt_tokens"]) == out.usage.prompt_tokens
    assert int(fields["output_tokens"]) == out.usage.completion_tokens and fields["proposer"] == "prompt_lookup"
    assert float(fields["ttft_ms"]) <= float(fields["duration_ms"]) and float(fields["tau"]) >= 1
    chat_fields = dict(part.split("=", 1) for part in lines[f"id={chat_id}"].split())
    assert chat_fields["op"] == "chat" and chat_fields["temperature"] == "0.5" and chat_fields["seed"] == "3"

    caplog.clear()
    quiet = AppThread(http_api.build_app(make_service(stack, log_requests=False), None))
    try:
        openai.OpenAI(base_url=quiet.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    finally:
        quiet.stop()
    assert not [r for r in caplog.records if r.name == "specmesh.requests"]


def test_access_log_only_when_asked(stack):
    """--access-log: uvicorn logs each HTTP request (method, path, status) on uvicorn.access; off by default."""
    for access_log in (False, True):
        app = AppThread(http_api.build_app(make_service(stack), None), access_log=access_log)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        access = logging.getLogger("uvicorn.access")  # uvicorn's own handler, not propagated to the root
        access.addHandler(handler)
        try:
            assert get(app.url + "/health")[0] == 200
        finally:
            access.removeHandler(handler)
            app.stop()
        lines = [r.getMessage() for r in records]
        assert (lines and "GET /health" in lines[0] and "200" in lines[0]) if access_log else not lines, lines


def test_request_line_quotes_what_needs_quoting():
    from orchestrator.service import Plan, request_line

    plan = Plan([1, 2, 3], SamplingParams(max_new_tokens=4, stop=("a b",)), None, 0, 0, True, "static", None, "chat")
    result = GenerationResult([7], "length", RequestStats(prompt_tokens=3))
    line = request_line("cmpl-1", plan, result, time.monotonic() - 0.5, None, ValueError('bad "x" = y'))
    assert line.startswith("id=cmpl-1 op=chat finish=error prompt_tokens=3 output_tokens=0 max_tokens=4 ")
    assert "ttft_ms" not in line and "tau" not in line and "proposer=none" in line and "stop=1" in line
    assert line.endswith('error="ValueError: bad \\"x\\" = y"') and "\n" not in line


def test_models_health_and_metrics(server, client):
    service, app = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert get(app.url + "/health") == get(app.url + "/readyz") == (200, b'{"status":"ok"}')
    assert get(app.url + "/livez") == (200, b'{"status":"alive"}')
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    load = json.loads(get(app.url + "/load")[1])
    assert load == {"requests": 0, "max_requests": service.max_requests, "running": 0, "waiting": 0, "preempted": 0,
                    "kv_blocks": load["kv_blocks"], "kv_blocks_used": 0, "kv_blocks_reserved": 0, "kv_usage": 0.0,
                    "draining": False}
    assert load["kv_blocks"] == sum(v.scheduler.verifier.allocator.num_blocks for v in service.backend.stack.shared_verifiers())
    status, body = get(app.url + "/metrics")
    assert status == 200 and b"specmesh_" in body


def test_sampling_with_a_seed_repeats(client):
    def sample() -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.8, seed=7,
                                         extra_body={"proposer": "draft_model", "policy": "static"}).choices[0].text

    assert sample() == sample()


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_gets_openai_errors(server):
    url = server[1].url + "/v1/completions"
    ok = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4}
    assert_openai_error(*post(url, b'{"model": "demo-target", "prompt": '), 400)
    assert_openai_error(*post(url, b"not json at all"), 400)
    assert_openai_error(*post(url, {**ok, "max_tokens": "four"}), 400, "max_tokens")
    assert_openai_error(*post(url, {**ok, "temperature": "hot"}), 400, "temperature")
    assert_openai_error(*post(url, {**ok, "prompt": {"text": "x"}}), 400)
    assert_openai_error(*post(url, {"model": MODEL}), 400, "prompt")
    assert_openai_error(*post(url, {**ok, "n": 17}), 400, "n")
    assert_openai_error(*post(url, {**ok, "n": 0}), 400, "n")
    assert_openai_error(*post(url, {**ok, "n": 2, "best_of": 1}), 400, "best_of")
    assert_openai_error(*post(url, {**ok, "best_of": 3, "stream": True}), 400, "best_of")
    assert_openai_error(*post(url, {**ok, "logprobs": 21}), 400, "logprobs")
    assert_openai_error(*post(url, {**ok, "presence_penalty": 2.5}), 400)
    assert_openai_error(*post(url, {**ok, "repetition_penalty": 0}), 400, "repetition_penalty")
    assert_openai_error(*post(url, {**ok, "logit_bias": {"x": 1}}), 400, "logit_bias")
    assert_openai_error(*post(url, {**ok, "logit_bias": {"7": 500}}), 400)
    assert_openai_error(*post(url, {**ok, "logit_bias": {str(10**6): 1}}), 400)
    assert_openai_error(*post(url, {**ok, "max_tokens": -1}), 400, "max_tokens")
    assert_openai_error(*post(url, {**ok, "max_tokens": 0}), 400, "max_tokens")
    status, body = post(url, {**ok, "max_tokens": 10**9})
    assert_openai_error(status, body, 400)
    assert "context" in body["error"]["message"]
    assert_openai_error(*post(url, {**ok, "prompt": ""}), 400)
    assert_openai_error(*post(url, {**ok, "prompt": [10**6]}), 400)
    assert_openai_error(*post(url, {**ok, "prompt": ["a", "b"]}), 400, "prompt")
    assert_openai_error(*post(url, {**ok, "proposer": "nonsense"}), 400)
    assert_openai_error(*post(url, {**ok, "top_p": 0}), 400, "top_p")
    status, body = post(url, {**ok, "model": "gpt-4"})
    assert_openai_error(status, body, 404, "model")
    assert body["error"]["code"] == "model_not_found"
    chat = server[1].url + "/v1/chat/completions"
    assert_openai_error(*post(chat, {"model": MODEL, "messages": []}), 400, "messages")
    assert_openai_error(*post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "top_logprobs": 2}), 400, "top_logprobs")
    assert_openai_error(*post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "logprobs": True, "top_logprobs": 30}), 400, "top_logprobs")
    assert_openai_error(*post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],  # no parser
                                     "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "tool_choice")
    assert_openai_error(*post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "tools": [{"type": "function", "function": {"name": "no spaces"}}],
                                     "tool_choice": "required"}), 400, "tools")
    status, body = get(server[1].url + "/v1/nothing")
    assert_openai_error(status, json.loads(body), 404)
    # the server still serves
    assert post(url, ok)[0] == 200


def test_bearer_token(stack):
    app = AppThread(http_api.build_app(make_service(stack), None, tokens=("s3cret", "other")))
    try:
        body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 2}
        assert_openai_error(*post(app.url + "/v1/completions", body), 401)
        assert_openai_error(*post(app.url + "/v1/completions", body, {"Authorization": "Bearer wrong"}), 401)
        assert post(app.url + "/v1/completions", body, {"Authorization": "Bearer other"})[0] == 200
        assert get(app.url + "/v1/models")[0] == 401
        assert get(app.url + "/health")[0] == 200 and get(app.url + "/metrics")[0] == 401  # as the --metrics port
        assert get(app.url + "/metrics", {"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=app.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=app.url + "/v1", api_key="s3cret", max_retries=0).models.list().data
    finally:
        app.stop()


def _open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def test_a_full_queue_is_429(stack):
    service = make_service(stack, max_concurrent=1, max_queued=0)
    app = AppThread(http_api.build_app(service, None))
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True, "proposer": "none"}
        conn, response = _open_stream(app.url, body)
        response.readline()  # the first event: the request is admitted and running
        status, error = post(app.url + "/v1/completions", {**body, "stream": False, "max_tokens": 2})
        assert_openai_error(status, error, 429)
        assert error["error"]["code"] == "rate_limit_exceeded"
        conn.close()
        assert wait_until(lambda: service.num_requests == 0, 30)
        assert post(app.url + "/v1/completions", {**body, "stream": False, "max_tokens": 2})[0] == 200
    finally:
        app.stop()


def test_a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_kv(stack, server, caplog):
    service, app = server
    caplog.set_level(logging.INFO, logger="specmesh.requests")
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 450, "temperature": 0, "stream": True,
            "ignore_eos": True, "proposer": "none"}
    conn, response = _open_stream(app.url, body)
    first = response.readline()
    assert first.startswith(b"data: ")
    assert wait_until(lambda: sum(v.num_sessions for v in stack.shared_verifiers()) == 1, 10)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    start = time.monotonic()
    assert wait_until(lambda: service.num_requests == 0 and sum(v.num_sessions for v in stack.shared_verifiers()) == 0,
                      30)
    assert time.monotonic() - start < 20  # cancelled, not run to its 450 tokens
    assert [r for r in caplog.records if r.name == "specmesh.requests" and " finish=aborted " in r.getMessage()]


# ------------------------------------------------------------------------------------------ real processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curl(*args: str) -> str:
    return subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True, text=True, check=True).stdout


def test_specmesh_serve_embedded_answers_curl(stack):
    port = free_port()
    proc = ServiceProcess(["-m", "specmesh", "serve", "--embedded", "--target", TARGET, "--draft", DRAFT,
                           "--dtype", "float64", "--threads", "1", "--http", f"127.0.0.1:{port}",
                           "--model-name", MODEL], name="serve --embedded")
    try:
        start_all(proc)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        answer = json.loads(curl(url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body))
        assert answer["choices"][0]["text"] == reference(stack, PROMPTS[0], 12)[0]
        assert answer["specmesh"]["proposer"] == "fused"  # the server's default proposer
        events = curl("-N", url + "/v1/completions", "-H", "Content-Type: application/json", "-d",
                      json.dumps({**json.loads(body), "stream": True}))
        lines = [line.removeprefix("data: ") for line in events.splitlines() if line]
        assert lines[-1] == "[DONE]"
        assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == answer["choices"][0]["text"]
        assert json.loads(curl(url + "/v1/models"))["data"][0]["id"] == MODEL
        assert b"specmesh_kv_cache_usage_perc" in get(url + "/metrics")[1]
    finally:
        proc.stop()


def test_no_verifier_up_is_503():
    port = free_port()
    v = verifier()
    start_all(v)
    proc = ServiceProcess(["-m", "specmesh", "serve", "--tokenizer", TARGET, "--verifier", v.address,
                           "--http", f"127.0.0.1:{port}", "--model-name", MODEL], name="serve")
    try:
        start_all(proc)
        url = f"http://127.0.0.1:{port}"
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        assert post(url + "/v1/completions", body)[0] == 200
        load = get(url + "/load")[1]
        assert json.loads(load) == {"requests": 0, "max_requests": 64 + 256, "running": 0, "waiting": 0,
                                    "verifiers": 1, "verifiers_healthy": 1, "draining": False}
        assert str(v.port).encode() not in load  # counts only: no replica's address to anyone who asks
        v.stop()
        status, error = post(url + "/v1/completions", body)
        assert_openai_error(status, error, 503)
        # the client is told what failed, not where: the log line of the request, under its id, says where
        message = error["error"]["message"]
        assert "127.0.0.1" not in message and str(v.port) not in message, message
        request_id = re.search(r"request (cmpl-\w+)", message).group(1)
        assert wait_until(lambda: re.search(rf"id={request_id} .*{v.port}", proc.log_text()) is not None, 10)
        with pytest.raises(grpc.RpcError) as err:
            Client(proc.address, timeout=30).generate(PROMPTS[0], max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.1" not in err.value.details() and "request gen-" in err.value.details(), err.value.details()
        assert get(url + "/health")[0] == get(url + "/readyz")[0] == 503 and get(url + "/livez")[0] == 200
        assert json.loads(get(url + "/load")[1])["verifiers_healthy"] == 0
    finally:
        proc.stop()
        v.stop()


def test_serve_metrics_equal_the_requests_own_stats(stack):
    from prometheus_client.parser import text_string_to_metric_families

    service = make_service(stack)
    app = AppThread(http_api.build_app(service, None))
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0)
        answers = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=t,
                                             extra_body={"proposer": proposer})
                   for prompt in PROMPTS for proposer, t in (("draft_model", 0), ("prompt_lookup", 0), ("fused", 0.7))]
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=9, temperature=0,
                                                stream=True, extra_body={"proposer": "draft_model"}))
        streamed = [c.model_extra["specmesh"] for c in chunks if c.choices and c.choices[0].finish_reason]
        stats = [a.model_extra["specmesh"] for a in answers] + streamed
        samples = {}
        for family in text_string_to_metric_families(get(app.url + "/metrics")[1].decode()):
            for s in family.samples:
                samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value

        def value(name: str, **labels) -> float:
            return samples.get(("specmesh_" + name, tuple(sorted(labels.items()))), 0.0)

        per_source = [s["per_source"] for s in stats]
        assert value("spec_decode_num_draft_tokens_total") == sum(v["proposed"] for p in per_source for v in p.values())
        assert value("spec_decode_num_accepted_tokens_total") == sum(v["accepted"] for p in per_source for v in p.values())
        for source in {k for p in per_source for k in p}:
            assert value("spec_decode_num_accepted_tokens_per_source_total", source=source) == \
                sum(p.get(source, {}).get("accepted", 0) for p in per_source)
        depth = max(len(s["accepted_per_position"]) for s in stats)
        for d in range(depth):
            assert value("spec_decode_num_accepted_tokens_per_pos_total", position=str(d)) == \
                sum(s["accepted_per_position"][d] for s in stats if d < len(s["accepted_per_position"]))
        assert value("spec_decode_tokens_per_step_count") == sum(s["steps"] for s in stats)
        generated = [a.usage.completion_tokens for a in answers] + [9]
        assert value("generation_tokens_total") == sum(generated)
        assert value("prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers) + \
            len(stack.tokenizer.encode(PROMPTS[0]))
        assert value("spec_decode_tokens_per_step_sum") == sum(generated) - len(generated)  # prefill's token: no step
        # the unseeded sampled answers may end at EOS
        reasons = [a.choices[0].finish_reason for a in answers] + ["length"]
        for reason in ("length", "stop"):
            assert value("request_success_total", finished_reason=reason) == reasons.count(reason)
        assert value("time_to_first_token_seconds_count") == len(generated)
        assert value("e2e_request_latency_seconds_count") == len(generated)
        assert value("num_requests_running") == 0 and value("num_requests_waiting") == 0
        assert value("verifier_num_sessions") == 0 and value("kv_cache_usage_perc") == 0
    finally:
        app.stop()


def test_chat_without_max_tokens_fills_the_rest_of_the_context(stack, client):
    context = stack.target_runner.info.max_positions

    def prompt_tokens_of(messages) -> int:
        return len(stack.tokenizer.encode(ChatTemplate(TEMPLATE).render(messages), add_special_tokens=False))

    lines = context
    while prompt_tokens_of(messages := [{"role": "user", "content": "x = 1\n" * lines}]) > context - 8:
        lines -= 4
    prompt_tokens = prompt_tokens_of(messages)
    assert context - 40 < prompt_tokens < context
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == context - prompt_tokens
    assert response.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_is_admitted_on_a_pool_smaller_than_the_context(stack):
    """Issue 31: on a pool of 592 tokens (37 blocks; the model's context is 2,048) the context served is what one request can
    hold there; three concurrent chats without max_tokens are admitted, preempt each other as they grow, and each
    runs to that context's end."""
    small = dataclasses.replace(stack, kv_cache_gb=592 * stack.target_runner.kv_bytes_per_token / 2**30, _core=None, _engines={},
                                _shared_lock=threading.Lock())
    service = make_service(small)
    app = AppThread(http_api.build_app(service, ChatTemplate(TEMPLATE, {"eos_token": "<|endoftext|>"})))
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        served = client.models.list().data[0].model_extra["max_model_len"]
        # the largest tree (256 nodes) and the largest lookahead window a request may ask for
        assert served == 592 - 1 - 256 - MAX_WINDOW_ROWS < stack.target_runner.info.max_positions
        messages = [[{"role": "user", "content": f"def f{i}(x):\n"}] for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda m: client.chat.completions.create(
                model=MODEL, messages=m, temperature=0, extra_body={"ignore_eos": True}), messages))
        for answer in answers:
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage.prompt_tokens + answer.usage.completion_tokens == served
        (core,) = small.shared_verifiers()  # one engine core, though the first requests came at once
        assert core.stats.preemptions > 0 and core.stats.max_batch > 1
        assert wait_until(lambda: core.verifier.allocator.num_used == 0, timeout=10)
    finally:
        app.stop()
        small.close()


def test_concurrent_http_requests_of_one_method_are_drafted_in_one_batch(stack, monkeypatch):
    """Issue 67: `serve`'s requests of one method share that method's proposer on the one engine core, so the
    core drafts them together: two HTTP clients at once with `draft_model` are drafted in one ``propose_batch`` (a
    draft model's one forward per level for both), and each gets plain greedy decoding's text. A request of
    another method (`prompt_lookup_tree`, `none`) runs on the same core and pool."""
    from drafter_service.draft_model import DraftModelProposer

    batches = []
    propose_batch = DraftModelProposer.propose_batch

    def recorded(self, states, budgets):
        batches.append(len(states))
        return propose_batch(self, states, budgets)

    monkeypatch.setattr(DraftModelProposer, "propose_batch", recorded)
    fresh = dataclasses.replace(stack, _core=None, _engines={}, _shared_lock=threading.Lock())
    service = make_service(fresh)
    app = AppThread(http_api.build_app(service, ChatTemplate(TEMPLATE, {"eos_token": "<|endoftext|>"})))
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["def fibonacci(n):\n", "class Stack:\n    def push(self, item):\n"]
        methods = ["draft_model", "draft_model", "prompt_lookup_tree", "none"]
        work = [(prompts[i % 2], method) for i, method in enumerate(methods)]
        start = threading.Barrier(len(work))

        def complete(item):
            prompt, method = item
            start.wait()
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                             extra_body={"ignore_eos": True, "proposer": method}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            texts = list(pool.map(complete, work))
        for (prompt, _), text in zip(work, texts, strict=True):
            assert text == reference(fresh, prompt, 48)[0]
        assert max(batches) == 2  # both draft_model requests in one call
        assert fresh.shared_verifiers() == [fresh.core]  # every method on the one core (one pool, one step thread)
    finally:
        app.stop()
        fresh.close()
