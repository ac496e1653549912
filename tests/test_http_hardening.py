"""The HTTP port under hostile or careless clients: TLS, slow and idle connections, large bodies, drain on
SIGTERM, closed documentation pages (the embedded demo stack of test_http_api, uvicorn on a thread, and one real
`specmesh serve` process for SIGTERM)."""

from __future__ import annotations

import concurrent.futures
import gc
import http.client
import json
import logging
import re
import signal
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest

from orchestrator.http_api import BODY_BYTES_PER_PROMPT_BYTE, BODY_OVERHEAD_BYTES, build_app
from orchestrator.http_server import HttpLimits, TlsFiles
from specmesh_app.local_mesh import ServiceProcess
from tests.service_helpers import DRAFT, TARGET, start_all, wait_until
from tests.test_http_api import (
    MODEL,
    PROMPTS,
    AppThread,
    assert_openai_error,
    free_port,
    get,
    http_stack,
    make_service,
    post,
    reference,
)
from tests.tls_helpers import make_pki


@pytest.fixture(scope="module")
def stack():
    yield from http_stack()


STREAM = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": True,
          "ignore_eos": True, "proposer": "none"}


def raw(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``within`` seconds without answering."""
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def response_head(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, everything received) of the answer on a raw socket, read until the server closes or pauses."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    except (TimeoutError, ConnectionResetError):
        pass
    return int(data.split(b" ", 2)[1]), data


def read_events(response: http.client.HTTPResponse) -> list[str]:
    return [line.decode().strip().removeprefix("data: ") for line in response if line.strip()]


# ------------------------------------------------------------------------------------------ TLS
def _https_get(url: str, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(url, timeout=30, context=context) as response:
        return response.status


def test_https_and_mutual_tls_on_the_http_port(stack, tmp_path):
    pki = make_pki(tmp_path)
    trusting = ssl.create_default_context(cafile=pki["ca"])
    app = AppThread(build_app(make_service(stack)), tls=TlsFiles(pki["server"], pki["server_key"]))
    try:
        assert app.url.startswith("https://")
        assert _https_get(app.url + "/health", trusting) == 200
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            get(app.url.replace("https://", "http://") + "/health")  # no plaintext answer on the port
    finally:
        app.stop()

    app = AppThread(build_app(make_service(stack)), tls=TlsFiles(pki["server"], pki["server_key"], pki["ca"]))
    try:
        with pytest.raises((urllib.error.URLError, ssl.SSLError, OSError)):
            _https_get(app.url + "/v1/models", trusting)  # no client certificate: no answer
        with_cert = ssl.create_default_context(cafile=pki["ca"])
        with_cert.load_cert_chain(pki["client"], pki["client_key"])
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}).encode()
        request = urllib.request.Request(app.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60, context=with_cert) as response:
            assert json.loads(response.read())["choices"][0]["text"] == reference(stack, PROMPTS[0], 6)[0]
    finally:
        app.stop()


# ------------------------------------------------------------------------------------------ slow clients
def test_slow_header_and_slow_body_clients_are_dropped_while_health_answers(stack):
    app = AppThread(build_app(make_service(stack)), HttpLimits(read_timeout=1.0, keep_alive=1.0))
    try:
        silent = raw(app.port)
        slow_header = raw(app.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        slow_body = raw(app.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        start = time.monotonic()
        assert get(app.url + "/health")[0] == 200  # served meanwhile
        for sock in (silent, slow_header, slow_body):
            assert closed_by_server(sock, within=5.0)
        assert time.monotonic() - start < 5.0
        assert get(app.url + "/health")[0] == 200
    finally:
        app.stop()


def test_a_flood_of_idle_connections_gives_way_to_new_ones_and_spares_answers_in_flight(stack):
    app = AppThread(build_app(make_service(stack)), HttpLimits(read_timeout=30.0, max_connections=8))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(STREAM), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        flood = [raw(app.port, b"GET /health HTTP/1.1\r\n") for _ in range(40)]  # 5x the cap, all idle
        statuses = [get(app.url + "/health")[0] for _ in range(3)]
        assert statuses == [200, 200, 200]  # the new connections take idle ones' places
        assert sum(closed_by_server(s, within=0.5) for s in flood) >= 40 - 8
        events = read_events(stream)  # the answer in flight was never the one closed
        assert events[-1] == "[DONE]"
        conn.close()
    finally:
        app.stop()


# ------------------------------------------------------------------------------------------ bodies
def test_bodies_past_the_limit_are_refused_before_they_are_read(stack):
    service = make_service(stack, max_prompt_bytes=1000)
    app = AppThread(build_app(service, tokens=("s3cret",)))
    limit = app.server.server.config.app.state.api.max_body_bytes
    assert limit == BODY_BYTES_PER_PROMPT_BYTE * 1000 + BODY_OVERHEAD_BYTES
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n"
    try:
        # 100 MB announced, none of it sent: the refusal comes at once, from the headers alone
        start = time.monotonic()
        status, data = response_head(raw(app.port, head.format(100_000_000, "Authorization: Bearer s3cret\r\n")
                                         .encode()))
        assert status == 413 and b"larger than" in data
        # 10 MB announced without a token: 401 before any of it is read
        status, data = response_head(raw(app.port, head.format(10_000_000, "").encode()))
        assert status == 401
        assert time.monotonic() - start < 3.0
        # no Content-Length: the body is counted as it streams in and cut past the limit
        sock = raw(app.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        try:
            for _ in range(limit // len(piece) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we finished: as intended
        status, data = response_head(sock)
        assert status == 413
        # a large valid body is parsed (off the event loop) and answered in OpenAI's shape
        ids = list(range(5, 2005)) * 20  # 40,000 ids, ~200 KB: past the prompt limit, inside the body limit
        status, error = post(app.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2},
                             {"Authorization": "Bearer s3cret"})
        assert_openai_error(status, error, 400)
        assert get(app.url + "/health")[0] == 200
    finally:
        app.stop()


def test_documentation_pages_need_the_token_or_are_off(stack):
    app = AppThread(build_app(make_service(stack), tokens=("s3cret",)))
    try:
        assert get(app.url + "/openapi.json")[0] == 401
        status, schema = get(app.url + "/openapi.json", {"Authorization": "Bearer s3cret"})
        schema = json.loads(schema)
        assert status == 200 and "/v1/completions" in schema["paths"]
        assert "CompletionRequest" in schema["components"]["schemas"]
        assert get(app.url + "/docs")[0] == 404 and get(app.url + "/redoc")[0] == 404
    finally:
        app.stop()
    app = AppThread(build_app(make_service(stack)))
    try:
        assert get(app.url + "/docs")[0] == 200 and get(app.url + "/openapi.json")[0] == 200
    finally:
        app.stop()


def test_n_and_best_of_below_one_say_so(stack):
    app = AppThread(build_app(make_service(stack)))
    try:
        for field, value in (("n", 0), ("n", -1), ("best_of", 0)):
            status, error = post(app.url + "/v1/completions", {"model": MODEL, "prompt": "x", field: value})
            assert_openai_error(status, error, 400, field)
            assert "must be in [" in error["error"]["message"]  # the allowed range, named
    finally:
        app.stop()


def test_choices_the_server_can_never_take_at_once_are_a_400_not_a_429(stack):
    app = AppThread(build_app(make_service(stack, max_concurrent=2, max_queued=1)))
    try:
        status, error = post(app.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1, "best_of": 4,
                                                           "max_tokens": 2})
        assert_openai_error(status, error, 400, "best_of")
        assert "--max-concurrent" in error["error"]["message"]
        status, error = post(app.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 4, "max_tokens": 2})
        assert_openai_error(status, error, 400)
        status, answer = post(app.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1, "best_of": 3,
                                                            "max_tokens": 2, "temperature": 0})
        assert status == 200 and len(answer["choices"]) == 1  # as many as it takes: served
    finally:
        app.stop()


def test_a_body_of_many_chat_messages_under_the_limit_leaves_the_event_loop_serving(stack):
    """50,000+ messages in a body just under the limit: one pydantic call over them held the interpreter lock,
    and so the event loop, for the whole parse (0.3-0.4 s here; 2 s for 8 at once) even from a worker thread.
    Parsed in slices, /livez keeps answering while it goes on."""
    service = make_service(stack)
    app = AppThread(build_app(service))
    limit = app.server.server.config.app.state.api.max_body_bytes
    one = {"role": "user", "content": "a"}
    count = (limit - 200) // (len(json.dumps(one)) + 2)
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [one] * count}).encode()
    assert limit - 100_000 < len(body) <= limit
    gaps, done = [], threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert get(app.url + "/livez")[0] == 200
            gaps.append(time.monotonic() - start)
            time.sleep(0.005)

    gc.freeze()  # as serve freezes its heap once built (host_runtime.freeze_heap): no full collection walks it
    try:
        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.1)
        start = time.monotonic()
        status, error = post(app.url + "/v1/chat/completions", body)
        took = time.monotonic() - start
        done.set()
        prober.join(30)
        assert_openai_error(status, error, 400)  # this app has no chat template: the parse is the work
        assert max(gaps) < 0.5 * took, (max(gaps), took)  # the loop was held for a part of the parse, not all
    finally:
        gc.unfreeze()
        done.set()
        app.stop()


# ------------------------------------------------------------------------------------------ drain
def test_a_drain_finishes_streams_and_answers_503_meanwhile(stack):
    app = AppThread(build_app(make_service(stack)))
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(STREAM), {"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.readline().startswith(b"data: ")
    load = json.loads(get(app.url + "/load")[1])
    assert load["running"] + load["waiting"] == load["requests"] == 1 and not load["draining"]
    stopped = app.drain(grace=60)
    assert wait_until(lambda: get(app.url + "/health")[0] == 503, 10)
    assert get(app.url + "/readyz")[0] == 503 and get(app.url + "/livez") == (200, b'{"status":"alive"}')
    assert json.loads(get(app.url + "/load")[1])["draining"]
    status, error = post(app.url + "/v1/completions", {**STREAM, "stream": False, "max_tokens": 2})
    assert_openai_error(status, error, 503)
    events = read_events(stream)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    stopped.result(30)
    with pytest.raises(OSError):
        raw(app.port)
    app.stop()


class Records(logging.Handler):
    """Every record of some loggers (uvicorn's do not reach the root logger, so caplog misses them)."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(n) for n in names]
        for logger in self.loggers:
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)
        super().close()

    def text(self) -> str:
        return "\n".join(r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
                         for r in self.records)


def test_requests_still_running_past_the_grace_end_as_their_clients_can_read(stack):
    """Past the drain's grace, a stream ends with an error event and [DONE], a request not answered yet with
    a JSON 503 in OpenAI's shape; the log has one line per cut request, no traceback."""
    app = AppThread(build_app(make_service(stack)))
    records = Records("uvicorn.error", "uvicorn", "specmesh.http", "asyncio")  # after uvicorn set its loggers up
    long = {**STREAM, "max_tokens": 1500}  # minutes of decoding: still running when the grace ends
    try:
        conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.readline().startswith(b"data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            unary = pool.submit(post, app.url + "/v1/completions", {**long, "stream": False})
            assert wait_until(lambda: json.loads(get(app.url + "/load")[1])["requests"] == 2, 10)
            start = time.monotonic()
            stopped = app.drain(grace=0.5)
            status, error = unary.result(30)
        assert_openai_error(status, error, 503)
        assert error["error"]["code"] == "service_unavailable" and "grace" in error["error"]["message"]
        events = read_events(stream)
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "service_unavailable"
        assert all("choices" in json.loads(e) for e in events[:-2])  # every event before is whole
        stopped.result(30)
        assert time.monotonic() - start < 10
        cut = [r for r in records.records if "cut at the end of the drain's grace" in r.getMessage()]
        assert len(cut) == 2, records.text()
        assert sum("error event and [DONE]" in r.getMessage() for r in cut) == 1
        assert sum("answered 503" in r.getMessage() for r in cut) == 1
        assert all(re.search(r"request cmpl-\w+ ", r.getMessage()) for r in cut), records.text()
        assert "Traceback" not in records.text() and "CancelledError" not in records.text(), records.text()
        assert not any(r.exc_info for r in records.records), records.text()
        conn.close()
    finally:
        records.close()
        app.stop()


def test_sigterm_lets_https_streams_finish_within_the_grace(stack, tmp_path):
    pki = make_pki(tmp_path)
    port = free_port()
    proc = ServiceProcess(["-m", "specmesh", "serve", "--embedded", "--target", TARGET, "--draft", DRAFT,
                           "--dtype", "float64", "--threads", "1", "--http", f"127.0.0.1:{port}",
                           "--model-name", MODEL, "--grace", "60", "--tls-cert", str(pki["server"]),
                           "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"])], name="serve --embedded")
    context = ssl.create_default_context(cafile=pki["ca"])
    context.load_cert_chain(pki["client"], pki["client_key"])
    try:
        start_all(proc)
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=context)
        conn.request("POST", "/v1/completions", json.dumps({**STREAM, "max_tokens": 200}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        proc.proc.send_signal(signal.SIGTERM)
        events = read_events(stream)
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert len(text) > 0 and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
