"""The OpenAI-compatible HTTP API (`specmesh serve --http HOST:PORT`), a FastAPI shell over GenerationService.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template; 400 when it
has none; function calling: orchestrator/tool_calls.py), ``GET /v1/models``, ``GET /health`` = ``GET /readyz`` (200 while a verifier is up, else 503; 503 while draining),
``GET /livez`` (200 while the process answers), ``GET /load`` (requests, running / waiting, KV usage, draining: a
router's view), ``GET /metrics`` (Prometheus), ``GET /openapi.json`` (behind the token when there is one; ``/docs`` and
``/redoc`` only without). The transport (TLS, timeouts, connection cap, drain) is orchestrator/http_server.py. Streaming is server-sent events ending in ``data: [DONE]``, with
``stream_options.include_usage``.

Speculation options ride as extra body fields (``SpecmeshOptions``: ``proposer``, ``max_nodes``,
``max_depth``, ``policy``, ``overlap``, ``restart_depth``, ``mjsd_threshold``, plus vLLM's ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``). ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty`` and ``logit_bias`` change the target's distribution, and speculation stays exact under them
(specmesh/logits_process.py), and every response carries the request's speculation stats under
``specmesh`` (non-streaming: in the response; streaming: in the chunk that carries the finish reason), whose
``lossy`` is true when the output may differ from the target's own (``proposer: "mjsd"``, asked for by name).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 bad input (malformed
JSON, wrong types, unsupported options such as ``suffix``, a prompt past the context), 401 a
missing or wrong bearer token when the server has tokens (checked before the body is read), 404 an unknown
model, 413 a body past the limit, 429 the queue is full, 503 no verifier is up or the server is draining. A client that disconnects mid-stream cancels its request: the engine stops at its next
step and releases the verifier's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import hmac
import inspect
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orchestrator import tool_calls
from orchestrator.service import (
    Chunk,
    Final,
    GenerateRequest,
    GenerationService,
    Overloaded,
    Plan,
    request_id_of,
)
from specmesh import package_version, rpc, tracing
from specmesh.chat import ChatTemplate, ChatTemplateError
from specmesh.contract import CapacityError, TokenLogprobs, UnknownSessionError
from specmesh.metrics import exposition
from specmesh.sampling import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("specmesh.http")

VERSION = package_version() or "unknown"  # unknown: run from a source tree that was never installed
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request sets none (0 = greedy)
OPENAI_DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' default max_tokens (chat: the rest of the context)
BODY_BYTES_PER_PROMPT_BYTE = 2  # a body may be this many times the prompt limit (JSON escapes, chat framing)...
BODY_OVERHEAD_BYTES = 1 << 20  # ...plus this much for the other fields
MAX_CHOICES = 16  # n and best_of at most: each choice is a request of its own
NEG_INF_LOGPROB = -9999.0  # a log-probability of -inf (outside top-k/top-p) in JSON, as vLLM writes it
TOKEN_TEXT_CACHE = 1 << 16  # token texts of the logprobs fields kept decoded
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on a worker thread, not on the event loop
MESSAGE_SLICE = 512  # chat messages validated per call of a large body (~2 ms each holding the interpreter lock)


# ---------------------------------------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status == 413:
            headers["Connection"] = "close"  # the rest of the body is not read
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(exc: Exception) -> ApiError:
    """The HTTP error for an exception of the request path (orchestrator/service.py lists them). Its message
    names no internal address or path: a failed upstream is told by its kind and status, with the request's id,
    under which the log line of the request (specmesh.requests) has the whole text."""
    if isinstance(exc, ApiError):
        return exc
    request_id = request_id_of(exc)
    if isinstance(exc, Overloaded | CapacityError):
        return ApiError(429, rpc.redact(str(exc)), "rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, rpc.UpstreamError):
        message = rpc.client_message(exc, request_id)
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ApiError(503, f"no verifier could serve the request: {message}", "server_error",
                            code="service_unavailable")
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ApiError(429, message, "rate_limit_error", code="rate_limit_exceeded")
        return ApiError(500, f"an upstream service failed: {message}", "server_error")
    if isinstance(exc, UnknownSessionError):
        return ApiError(503, rpc.with_request_id("the verifier lost the session", request_id), "server_error",
                        code="service_unavailable")
    if isinstance(exc, ValueError):
        return ApiError(400, rpc.redact(str(exc)))
    log.error("request %s failed", request_id or "(before admission)", exc_info=exc)
    return ApiError(500, rpc.with_request_id(f"internal error ({type(exc).__name__})", request_id), "server_error")


# ---------------------------------------------------------------------------------------------------- bodies
class SpecmeshOptions(BaseModel):
    """Extra body fields (the openai client's ``extra_body``): how to speculate, and vLLM's sampling extras."""

    proposer: str | None = Field(None, description="proposer name, or 'none' for plain decoding (default: the "
                                                   "server's)")
    max_nodes: int | None = Field(None, ge=0, description="tree budget: nodes per step (default: the proposer's)")
    max_depth: int | None = Field(None, ge=0, description="tree budget: depth per step (default: the proposer's)")
    policy: Literal["static", "adaptive"] | None = None
    overlap: bool | None = Field(None, description="PEARL: draft the next tree while verifying this one")
    restart_depth: int | None = Field(None, ge=0)
    mjsd_threshold: float | None = Field(None, gt=0, description="proposer mjsd (LOSSY, greedy only): accept the "
                                         "longest drafted prefix whose joint likelihood ratio p/q reaches this "
                                         "(default: the server's)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0 = off)")
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    repetition_penalty: float | None = Field(None, gt=0, description="CTRL's: the logits of tokens in the prompt "
                                             "or output are divided by it where positive, multiplied where "
                                             "negative (1 = off)")
    # vLLM's structured output fields (at most one, and not with a non-text response_format)
    guided_json: dict[str, Any] | str | None = Field(None, description="the output follows this JSON Schema")
    guided_regex: str | None = Field(None, description="the output matches this regular expression")
    guided_grammar: str | None = Field(None, description="the output follows this Lark grammar")
    guided_choice: list[str] | None = Field(None, description="the output is one of these strings")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(SpecmeshOptions):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields specmesh has no use for (user, metadata, ...)

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text instead of being cut
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema (structured output)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(OPENAI_DEFAULT_COMPLETION_TOKENS, ge=1)
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as they are

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: rendered messages already hold theirs
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _refuse_unsupported(body: _Common) -> None:
    """A clear 400 for every OpenAI option specmesh cannot honour, instead of silently ignoring it."""
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {body.n}", param="n")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", param="logprobs")
        if body.best_of is not None and not (body.n or 1) <= body.best_of <= MAX_CHOICES:
            raise ApiError(400, f"best_of must be in [n, {MAX_CHOICES}], got {body.best_of}", param="best_of")
        if body.best_of is not None and body.best_of > (body.n or 1) and body.stream:
            raise ApiError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
        if body.suffix:
            raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                           param="top_logprobs")
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


Body = TypeVar("Body", bound=BaseModel)


def invalid_body(errors: Sequence[dict]) -> ApiError:
    """The 400 for a body that failed validation (pydantic's error list; the first error is reported)."""
    first = errors[0] if errors else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        message, where = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), []
    else:
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
    return ApiError(400, message, param=".".join(where) or None)


async def read_body(request: Request, model: type[Body], limit: int) -> Body:
    """The request's JSON body as ``model``: refused (413) past ``limit`` bytes, by its Content-Length before any
    of it is read and while it streams in otherwise; large bodies are parsed on a worker thread so the event
    loop keeps serving."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise _too_large(None, limit)
    except ClientDisconnect:  # gone, or closed by the read timeout: nobody reads this answer
        raise ApiError(400, "the client disconnected before its request arrived") from None
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(_parse_in_slices, model, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


_MESSAGES = TypeAdapter(list[ChatMessage])


def _parse_in_slices(model: type[Body], body: bytes) -> Body:
    """A large body as ``model``, on a worker thread, letting the event loop run between pieces: pydantic holds
    the interpreter lock for a whole call, so one call over 50,000 chat messages (a body under the limit) held
    the loop 0.3 s from its thread; messages are validated MESSAGE_SLICE at a time instead, the lock given up
    between slices, and the rest of the body (small fields, flat lists of numbers or strings) in one call."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    messages = raw.get("messages") if isinstance(raw, dict) else None
    if "messages" in model.model_fields and isinstance(messages, list) and len(messages) > MESSAGE_SLICE:
        checked = []
        for start in range(0, len(messages), MESSAGE_SLICE):
            time.sleep(0)  # the interpreter lock to the event loop between slices
            try:
                checked += _MESSAGES.validate_python(messages[start:start + MESSAGE_SLICE])
            except ValidationError as exc:
                errors = [{**e, "loc": ("messages", start + e["loc"][0], *e["loc"][1:])} if e["loc"] else e
                          for e in exc.errors()]
                raise invalid_body(errors) from None
        raw = {**raw, "messages": checked}
    time.sleep(0)
    return model.model_validate(raw)


def _too_large(size: int | None, limit: int) -> ApiError:
    return ApiError(413, f"the request body {f'({size} bytes) ' if size else ''}is larger than the {limit} bytes "
                         "this server accepts (derived from --max-prompt-bytes)", code="request_too_large")


def _logit_bias(body: _Common) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as SamplingParams takes it."""
    bias = []
    for key, value in (body.logit_bias or {}).items():
        try:
            bias.append((int(key), float(value)))
        except ValueError:
            raise ApiError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
    return tuple(sorted(bias))


def _grammar(body: _Common) -> tuple[str, str] | None:
    """The structured output a request asks for (``response_format`` or one of vLLM's ``guided_*``), as
    SamplingParams.grammar takes it; a 400 for a malformed or double one."""
    asked = []
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        asked.append(("json_object", ""))
    elif kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                           param="response_format")
        asked.append(("json_schema", json.dumps(schema)))
    elif kind != "text":
        raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format")
    if body.guided_json is not None:
        spec = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(("json_schema", spec))
    if body.guided_regex is not None:
        asked.append(("regex", body.guided_regex))
    if body.guided_grammar is not None:
        asked.append(("lark", body.guided_grammar))
    if body.guided_choice is not None:
        if not body.guided_choice:
            raise ApiError(400, "guided_choice needs at least one choice", param="guided_choice")
        asked.append(("regex", "|".join(f"({re.escape(c)})" for c in body.guided_choice)))
    if len(asked) > 1:
        raise ApiError(400, "ask for one structured output: response_format or one guided_* field",
                       param="response_format")
    return asked[0] if asked else None


def _sampling(body: _Common, max_tokens: int, logprobs: int | None = None,
              forced: tuple[str, str] | None = None) -> SamplingParams:
    """``forced``: the grammar a tool_choice imposes (with it, the body may ask for no structured output)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = _logit_bias(body)
    grammar = _grammar(body)
    if forced is not None:
        if grammar is not None:
            raise ApiError(400, "tool_choice \"required\" or a named function constrains the output already: send no "
                                "response_format or guided_* field with it", param="tool_choice")
        grammar = forced
    try:
        return SamplingParams(
            temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=body.top_k, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
            max_new_tokens=max_tokens, stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty, logit_bias=bias,
            logprobs=logprobs, grammar=grammar,
            **({} if body.mjsd_threshold is None else {"mjsd_threshold": body.mjsd_threshold}))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _speculation(body: _Common) -> dict:
    return dict(proposer=body.proposer, max_nodes=body.max_nodes, max_depth=body.max_depth, overlap=body.overlap,
                policy=body.policy, restart_depth=body.restart_depth)


def stats_extension(plan: Plan, final: Final) -> dict:
    """The ``specmesh`` field of a response: the request's speculation stats."""
    stats = final.result.stats
    accepted, reached = stats.position_counts()
    return {
        "proposer": plan.proposer or "none",
        "max_nodes": plan.max_nodes,  # the request's tree budget per step
        "max_depth": plan.max_depth,
        "acceptance": stats.acceptance,
        "acceptance_rate": stats.acceptance_rate,
        "lossy": stats.lossy,  # the output may differ from the target's own decoding (mjsd)
        "steps": stats.num_steps,
        "tau": stats.tau,
        "acceptance_per_position": stats.acceptance_per_position(),
        "accepted_per_position": accepted,
        "reached_per_position": reached,
        "per_source": stats.per_source(),
        "draft_errors": stats.num_draft_errors,
        "prefill_seconds": stats.prefill_seconds,
        "total_seconds": stats.total_seconds,
        "tokens_per_second": stats.tokens_per_second,
    }


def _usage(plan: Plan, finals: Sequence[Final]) -> dict:
    """Token counts: the prompt once, every choice's output."""
    out = sum(final.result.stats.num_generated for final in finals)
    return {"prompt_tokens": len(plan.prompt), "completion_tokens": out, "total_tokens": len(plan.prompt) + out}


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


# ---------------------------------------------------------------------------------------------------- the app
class OpenAIApi:
    """The routes' state: the service, the chat template, the accepted tokens, the body limit; ``draining``
    (readiness and new generation requests answer 503) and the generation requests in flight."""

    def __init__(self, service: GenerationService, chat_template: ChatTemplate | None, tokens: Sequence[str] = (),
                 request_timeout: float | None = None, max_body_bytes: int | None = None,
                 model_names: Sequence[str] = (), tool_parser: str | None = None) -> None:
        self.service, self.chat_template, self.tokens = service, chat_template, tuple(tokens)
        self.tool_parser = tool_parser  # tool_choice "auto"'s parser (None: auto is refused)
        self.model_names = tuple(dict.fromkeys([service.model_name, *model_names]))
        self._token_texts: dict[int, str] = {}
        self.request_timeout = request_timeout
        self.max_body_bytes = max_body_bytes or (BODY_BYTES_PER_PROMPT_BYTE * service.max_prompt_bytes
                                                 + BODY_OVERHEAD_BYTES)
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0
        self.running: set[asyncio.Task] = set()  # the generation requests' tasks (CountInFlight)
        self.cut_requested = False

    def token_text(self, token_id: int) -> str:
        """One token's text as the logprobs fields show it (cached: alternatives repeat across tokens)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if len(self._token_texts) >= TOKEN_TEXT_CACHE:
                self._token_texts.clear()
            text = self._token_texts[token_id] = self.service.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def drain(self) -> None:
        self.draining = True

    def cut(self) -> int:
        """End the generation requests still running (the drain's grace is over), each with an answer its client
        can read (``CountInFlight``); how many there were."""
        self.cut_requested = True
        for task in list(self.running):
            task.cancel()
        return len(self.running)

    def accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica", "server_error",
                           code="service_unavailable")

    def authorize(self, request: Request) -> None:
        if not self.tokens:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens):
            raise ApiError(401, "missing or invalid bearer token (Authorization: Bearer <token>)",
                           code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            served = " or ".join(map(repr, self.model_names))
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    async def start(self, request: GenerateRequest, request_id: str, fill_context: bool = False
                    ) -> tuple[Plan, AsyncIterator[Chunk | Final], Chunk | Final]:
        """Check, admit and prefill: errors before the first token still get their own status code.
        ``request_id``: the response's id (the request's log line and span carry it). ``fill_context``:
        generate up to the rest of the context (the request's max_new_tokens is a placeholder of 1, so the
        check that the prompt leaves room for one token is the plan's own)."""
        plan = await self.service.prepare(request)
        if fill_context:
            rest = self.service.info.max_positions - len(plan.prompt)
            plan = dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling, max_new_tokens=rest))
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        stream = self.service.stream(plan, deadline, request_id)
        first = await anext(stream)
        return plan, stream, first

    # ------------------------------------------------------------------------------------------ completions
    async def start_choices(self, request: GenerateRequest, request_id: str, count: int, fill_context: bool = False
                            ) -> list[tuple[Plan, AsyncIterator[Chunk | Final], Chunk | Final]]:
        """``start`` for each of ``count`` independent choices of one prompt (n, best_of): the first alone, so that
        the others find its prompt in the verifier's prefix cache, then the rest together. A seeded request's
        choice i samples with seed + i. A failure closes the choices started. More choices than the server ever
        takes at once (--max-concurrent + --max-queued) is a 400: a 429 would say that retrying can help."""
        if count > self.service.max_requests:
            raise ApiError(400, f"{count} choices (n, best_of) are more than the {self.service.max_requests} "
                                "requests this server takes at once (--max-concurrent + --max-queued)",
                           param="best_of" if request.operation == "text_completion" else "n")
        first = await self.start(request, request_id, fill_context)
        if count == 1:
            return [first]
        seed = request.sampling.seed

        def choice(i: int) -> GenerateRequest:
            if seed is None:
                return request
            return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed + i))

        started = await asyncio.gather(*(self.start(choice(i), f"{request_id}-{i}", fill_context)
                                         for i in range(1, count)), return_exceptions=True)
        failed = next((x for x in started if isinstance(x, BaseException)), None)
        if failed is not None:
            for x in [first, *started]:
                if not isinstance(x, BaseException):
                    await x[1].aclose()
            raise failed
        return [first, *started]

    async def completions(self, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "a list of prompts is not supported: send one request per prompt", param="prompt")
            prompt = prompt[0]
        text_prompt = prompt if isinstance(prompt, str) else None
        n, best_of = body.n or 1, body.best_of or body.n or 1
        # best_of ranks the candidates by their tokens' log-probabilities: asked for even when the client did not
        logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
        request = GenerateRequest(_sampling(body, body.max_tokens or OPENAI_DEFAULT_COMPLETION_TOKENS, logprobs),
                                  prompt=text_prompt, token_ids=None if text_prompt is not None else list(prompt),
                                  operation="text_completion", **_speculation(body))
        rid, model = f"cmpl-{uuid.uuid4().hex}", self.service.model_name
        note_request_id(rid)
        choices = await self.start_choices(request, rid, best_of)
        plan = choices[0][0]
        echo = (text_prompt if text_prompt is not None else self.service.decode(plan.prompt)) if body.echo else ""
        offsets: dict[int, int] = {}  # per choice: text_offset of its next token's logprobs

        def chunk(text: str, finish: str | None = None, logprobs: TokenLogprobs | None = None, index: int = 0,
                  **extra) -> dict:
            entry = None
            if logprobs is not None and body.logprobs is not None:
                entry, offsets[index] = self.completion_logprobs(logprobs, offsets.get(index, len(echo)))
            choice = {"index": index, "text": text, "logprobs": entry, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [choice], **extra}

        if not body.stream:
            results = await _collect_all(choices)
            if best_of > n:  # the n candidates whose tokens are the most likely under their own distributions
                results.sort(key=lambda r: -sum(r[2].logprobs) if r[2] is not None else 0.0)
                results = results[:n]
            out = [chunk(echo + text, final.result.finish_reason, logprobs, index=i)["choices"][0]
                   for i, (text, final, logprobs) in enumerate(results)]
            return JSONResponse({**chunk(""), "choices": out, "usage": _usage(plan, [r[1] for r in results]),
                                 "specmesh": _choices_stats(plan, [r[1] for r in results])})

        return _event_stream(plan, choices, chunk, [chunk(echo, index=i) for i in range(n)] if echo else [],
                             body.stream_options)

    # ------------------------------------------------------------------------------------------ logprobs
    def completion_logprobs(self, lp: TokenLogprobs, offset: int) -> tuple[dict, int]:
        """The completions API's ``logprobs`` of some tokens (tokens, token_logprobs, top_logprobs, text_offset),
        their text starting at character ``offset``; and the offset after them."""
        tokens = [self.token_text(t) for t in lp.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = [{self.token_text(t): _finite(v) for t, v in zip(ids, values, strict=True)}
               for ids, values in zip(lp.top_ids, lp.top_logprobs, strict=True)] if lp.top_ids else None
        return {"tokens": tokens, "token_logprobs": [_finite(v) for v in lp.logprobs], "top_logprobs": top,
                "text_offset": offsets}, offset

    def chat_logprobs(self, lp: TokenLogprobs) -> dict:
        """The chat API's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _finite(value), "bytes": list(text.encode())}

        tops = lp.top_ids or ((),) * len(lp)
        values = lp.top_logprobs or ((),) * len(lp)
        return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in zip(ids, vals, strict=True)]}
                            for t, v, ids, vals in zip(lp.token_ids, lp.logprobs, tops, values, strict=True)]}


    # ------------------------------------------------------------------------------------------ tokenizer
    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: Sequence[dict] = ()) -> str:
        if self.chat_template is None:
            raise ApiError(400, f"the model {self.service.model_name!r} has no chat template (none in its "
                                "tokenizer_config.json or chat_template.jinja; `serve --chat-template` gives one); "
                                "use /v1/completions", param="messages")
        dumped, variables = tool_calls.render_messages([m.model_dump(exclude_none=True) for m in messages], tools,
                                                       self.chat_template.reads("tools"))
        try:
            return self.chat_template.render(dumped, add_generation_prompt, **variables)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def tool_plan(self, body: ChatRequest) -> tool_calls.ToolPlan | None:
        try:
            return tool_calls.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)
        except tool_calls.ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:
            self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        text = body.prompt if body.prompt is not None else self.render_chat(body.messages, body.add_generation_prompt)
        if len(text.encode()) > self.service.max_prompt_bytes:
            raise ApiError(400, f"the prompt is larger than {self.service.max_prompt_bytes} bytes", param="prompt")
        special = body.add_special_tokens and body.prompt is not None
        ids = list(self.service.tokenizer.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": self.service.info.max_positions, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self.check_model(body.model)
        vocab = self.service.info.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="tokens")
        return {"prompt": self.service.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # ------------------------------------------------------------------------------------------ chat
    async def chat(self, body: ChatRequest) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body)
        tools = self.tool_plan(body)  # None: no tools (orchestrator/tool_calls.py)
        render = functools.partial(self.render_chat, body.messages, tools=tools.tools if tools else ())
        # many messages take the template long (dumping each, then Jinja): on a thread, off the event loop
        prompt = await asyncio.to_thread(render) if len(body.messages) > MESSAGE_SLICE else render()
        max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of the context (OpenAI's)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = _sampling(body, max_tokens or 1, logprobs, tools.grammar if tools else None)
        request = GenerateRequest(sampling, prompt=prompt, operation="chat", add_special_tokens=False,
                                  **_speculation(body))
        rid, model, n = f"chatcmpl-{uuid.uuid4().hex}", self.service.model_name, body.n or 1
        note_request_id(rid)
        choices = await self.start_choices(request, rid, n, fill_context=max_tokens is None)
        plan = choices[0][0]

        def chunk(delta: dict, finish: str | None = None, logprobs: TokenLogprobs | None = None, index: int = 0,
                  **extra) -> dict:
            entry = None if logprobs is None else self.chat_logprobs(logprobs)
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": entry, "finish_reason": finish}], **extra}

        if not body.stream:
            results = await _collect_all(choices)
            messages = []
            for i, (text, final, logprobs) in enumerate(results):
                content, calls = tool_calls.extract(tools, text) if tools is not None else (text, [])
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                messages.append({"index": i, "message": message,
                                 "logprobs": None if logprobs is None else self.chat_logprobs(logprobs),
                                 "finish_reason": _finish_reason(final.result.finish_reason, calls)})
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": messages,
                "usage": _usage(plan, [r[1] for r in results]), "specmesh": _choices_stats(plan, [r[1] for r in results])})

        streams = [tool_calls.CallStream(tools) if tools is not None else None for _ in range(n)]

        def text_chunk(text: str, finish: str | None = None, logprobs: TokenLogprobs | None = None, index: int = 0,
                       **extra) -> dict:
            calls_stream = streams[index] if index < len(streams) else None
            if calls_stream is None:
                return chunk({"content": text} if text else {}, finish, logprobs, index, **extra)
            delta = calls_stream.push(text, done=finish is not None)
            return chunk(delta, _finish_reason(finish, calls_stream.calls) if finish else None, logprobs, index,
                         **extra)

        opening = [chunk({"role": "assistant", "content": ""}, index=i) for i in range(n)]
        return _event_stream(plan, choices, text_chunk, opening, body.stream_options)


def _finish_reason(reason: str | None, calls: Sequence[dict]) -> str | None:
    """A choice's finish_reason: "tool_calls" when it ended (not cut short) with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


async def _collect(first: Chunk | Final, stream: AsyncIterator[Chunk | Final]
                   ) -> tuple[str, Final, TokenLogprobs | None]:
    """The whole text, the end, and every token's log-probabilities (None unless the request asked)."""
    parts, logprobs = [], []
    async with contextlib.aclosing(stream):
        item = first
        while not isinstance(item, Final):
            parts.append(item.text)
            logprobs.append(item.logprobs)
            item = await anext(stream)
    return "".join(parts) + item.text, item, TokenLogprobs.join(logprobs)


async def _collect_all(choices) -> list[tuple[str, Final, TokenLogprobs | None]]:
    """``_collect`` of every choice, concurrently; a failure closes the others."""
    tasks = [asyncio.ensure_future(_collect(first, stream)) for _, stream, first in choices]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for _, stream, _ in choices:
            await stream.aclose()
        raise


def _choices_stats(plan: Plan, finals: Sequence[Final]) -> dict:
    """The ``specmesh`` field: the first choice's speculation stats, and with n > 1 every choice's under
    ``choices``."""
    stats = stats_extension(plan, finals[0])
    if len(finals) > 1:
        stats["choices"] = [stats_extension(plan, final) for final in finals]
    return stats


def _finite(value: float) -> float:
    """A log-probability for JSON: -inf (a token outside top-k/top-p) as vLLM writes it."""
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


async def _items(first: Chunk | Final, stream) -> AsyncIterator[Chunk | Final | ApiError]:
    """The stream's items; a failure after the response started becomes an ApiError item (the status is sent).
    Closing this (the client disconnected) closes the request's stream, which cancels it."""
    async with contextlib.aclosing(stream):
        yield first
        try:
            async for item in stream:
                yield item
        except Exception as exc:
            yield api_error(exc)


async def _mapped(request: Request, exc: Exception) -> JSONResponse:
    return api_error(exc).response()


def _event_stream(plan: Plan, choices, text_chunk: Callable, opening: list[dict],
                  options: StreamOptions | None) -> StreamingResponse:
    """The SSE response of a streamed request: ``opening`` chunks, then each choice's chunks as its tokens come
    (``text_chunk(text, finish_reason=None, logprobs=None, index=0, **extra)`` shapes one; a chunk per non-empty
    piece of text or set of logprobs), each choice's finishing chunk with its ``specmesh`` stats, the usage chunk
    when asked for (every choice's tokens), ``[DONE]``; a failure mid-stream is an ``error`` event.
    ``choices``: (plan, stream, first item) of each choice (n of them)."""

    async def events() -> AsyncIterator[bytes]:
        for piece in opening:
            yield _sse(piece)
        finals, failed = [], False
        async with contextlib.aclosing(_merged([_items(first, stream) for _, stream, first in choices])) as merged:
            async for index, item in merged:
                if isinstance(item, ApiError):
                    yield _sse(item.body())
                    failed = True
                    break
                if isinstance(item, Final):
                    finals.append(item)
                    yield _sse(text_chunk(item.text, item.result.finish_reason, index=index,
                                          specmesh=stats_extension(plan, item)))
                elif item.text or item.logprobs is not None:  # logprobs go out with their tokens, text or not yet
                    yield _sse(text_chunk(item.text, logprobs=item.logprobs, index=index))
        if not failed and options and options.include_usage:
            yield _sse({**text_chunk(""), "choices": [], "usage": _usage(plan, finals)})
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index, item) of several async iterators as their items come; closing this closes all of them."""
    if len(streams) == 1:  # the common case: no tasks
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        async with contextlib.aclosing(stream):
            async for item in stream:
                await queue.put((index, item))
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_REQUEST_IDS: contextvars.ContextVar[list[str]] = contextvars.ContextVar("specmesh_request_ids")


def note_request_id(request_id: str) -> None:
    """Tell ``CountInFlight`` the id of the request it runs (for its line when the request is cut)."""
    if (ids := _REQUEST_IDS.get(None)) is not None:
        ids.append(request_id)


CUT_MESSAGE = "the server is shutting down and its grace period ended before this request did; retry it"


class CountInFlight:
    """ASGI middleware counting the generation requests in flight (streams until their last byte): what a
    drain waits for; ``OpenAIApi.cut`` ends those still running when the drain's grace is over, each as a client
    can read it: a stream with an ``error`` event and ``[DONE]``, a request not answered yet with a JSON 503, and
    one log line each (instead of uvicorn cancelling them: a stream cut mid-event, a text/plain 500, a
    CancelledError traceback)."""

    def __init__(self, app, api: OpenAIApi) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        state = {"started": False, "stream": False, "ended": False}

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                state["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                      for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        ids: list[str] = []
        token = _REQUEST_IDS.set(ids)
        task = asyncio.ensure_future(self.app(scope, receive, tracked))  # (copies the context: ids is shared)
        _REQUEST_IDS.reset(token)
        self.api.in_flight += 1
        self.api.running.add(task)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self.api.cut_requested or (current is not None and current.cancelling()):
                raise  # the connection went away or the server stops: nobody to answer
            await self._answer_cut(scope, send, state, ids)
        finally:
            self.api.running.discard(task)
            self.api.in_flight -= 1
            if not task.done():
                task.cancel()

    async def _answer_cut(self, scope, send, state: dict, ids: list[str]) -> None:
        error = ApiError(503, CUT_MESSAGE, "server_error", code="service_unavailable")
        how = "nothing more could be sent"
        try:
            if not state["started"]:
                response = error.response()
                await send({"type": "http.response.start", "status": 503, "headers": response.raw_headers})
                await send({"type": "http.response.body", "body": response.body})
                how = "answered 503"
            elif state["stream"] and not state["ended"]:
                await send({"type": "http.response.body", "body": _sse(error.body()) + _sse("[DONE]")})
                how = "its stream ended with an error event and [DONE]"
        except OSError:  # the client is gone meanwhile
            pass
        log.warning("HTTP: request %s (%s) cut at the end of the drain's grace: %s",
                    ",".join(ids) or "(not admitted)", scope["path"], how)


WARM_UP_PROMPT = "def add(a, b):"


def warm_up(app: FastAPI, max_tokens: int = 4) -> list[int]:
    """Send the app its first requests in process, before its port opens: a completion and a streamed one (and a
    chat completion when it has a chat template), plain decoding (``proposer: "none"``: no proposer learns from
    them), each through the whole HTTP path (routing, body validation, tokenizing, the engine, the response's
    encoding), so the first user's request pays none of their first-call costs. Returns their status codes (200
    each; the caller logs anything else)."""
    api: OpenAIApi = app.state.api
    headers = [(b"content-type", b"application/json")]
    if api.tokens:
        headers.append((b"authorization", f"Bearer {api.tokens[0]}".encode()))
    base = {"model": api.model_names[0], "max_tokens": max_tokens, "temperature": 0, "proposer": "none"}
    calls = [("/v1/completions", {**base, "prompt": WARM_UP_PROMPT}),
             ("/v1/completions", {**base, "prompt": WARM_UP_PROMPT, "stream": True})]
    if api.chat_template is not None:
        calls.append(("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": WARM_UP_PROMPT}]}))

    async def call(path: str, body: dict) -> int:
        data = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [*headers, (b"content-length", str(len(data)).encode())],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        sent, status = [False], [0]

        async def receive() -> dict:
            if sent[0]:
                await asyncio.Event().wait()  # nothing more comes: the app ends the response first
            sent[0] = True
            return {"type": "http.request", "body": data, "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]

        await app(scope, receive, send)
        return status[0]

    async def run() -> list[int]:
        return [await call(path, body) for path, body in calls]

    return asyncio.run(run())


def build_app(service: GenerationService, chat_template: ChatTemplate | None = None, tokens: Sequence[str] = (),
              request_timeout: float | None = None, max_body_bytes: int | None = None,
              model_names: Sequence[str] = (), tool_parser: str | None = None) -> FastAPI:
    """The FastAPI app (its OpenAIApi is ``app.state.api``); ``tokens``: bearer tokens accepted (none = no
    authentication; /health (= /readyz), /livez, /load and /metrics are always open, as /health and /metrics in vLLM; with tokens, /openapi.json needs one and
    the /docs and /redoc pages are off, since a browser cannot send it); ``request_timeout``: seconds a request
    may run (None = unbounded); ``max_body_bytes``: the largest body accepted (default: derived from the
    service's prompt limit); ``model_names``: the names a request's ``model`` may give (default: the service's
    ``model_name`` alone; vLLM's --served-model-name), each listed by /v1/models; ``tool_parser``: how tool_choice
    "auto" reads calls from the output (orchestrator/tool_calls.py's PARSERS; None: "auto" is refused, as vLLM
    without --enable-auto-tool-choice)."""
    api = OpenAIApi(service, chat_template, tokens, request_timeout, max_body_bytes, model_names, tool_parser)
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over speculative decoding",
                  version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None, **_telemetry())
    app.state.api = api
    auth = [Depends(api.authorize)]
    generation = [*auth, Depends(api.accepting)]  # checked before the body is read

    app.add_middleware(CountInFlight, api=api)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_body(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    for expected in (ValueError, Overloaded, CapacityError, rpc.UpstreamError, UnknownSessionError):
        app.add_exception_handler(expected, _mapped)  # the request path's failures (orchestrator/service.py)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    @app.post("/v1/completions", dependencies=generation, openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await api.completions(await read_body(request, CompletionRequest, api.max_body_bytes))

    @app.post("/v1/chat/completions", dependencies=generation, openapi_extra=_request_body(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await api.chat(await read_body(request, ChatRequest, api.max_body_bytes))

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": api.created, "owned_by": "specmesh",
            "max_model_len": service.info.max_positions} for name in api.model_names]}

    @app.post("/tokenize", dependencies=auth, openapi_extra=_request_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = await read_body(request, TokenizeRequest, api.max_body_bytes)
        return await asyncio.to_thread(api.tokenize, body)

    @app.post("/detokenize", dependencies=auth, openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        return api.detokenize(await read_body(request, DetokenizeRequest, api.max_body_bytes))

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/health")
    @app.get("/readyz")
    async def health() -> Response:
        """Readiness: 200 while requests can be served; 503 while draining or with no verifier up."""
        if api.draining:
            return ApiError(503, "the server is shutting down", "server_error", code="service_unavailable").response()
        if await asyncio.get_running_loop().run_in_executor(None, service.healthy):
            return JSONResponse({"status": "ok"})
        return ApiError(503, "no verifier is serving", "server_error", code="service_unavailable").response()

    @app.get("/livez")
    async def live() -> dict:
        """Liveness: the process answers (draining and without a verifier too: a restart would not help)."""
        return {"status": "alive"}

    @app.get("/load")
    async def load() -> dict:
        """What a router reads: requests in flight, their limit, running / waiting, KV usage, draining."""
        return {**service.load(), "draining": api.draining}

    @app.get("/metrics", dependencies=auth)  # the --metrics port's rule: the token when there are tokens
    async def metrics(request: Request) -> Response:
        """The format the scraper asks for (OpenMetrics for a Prometheus server), as the --metrics port answers."""
        body, content_type = exposition(service.metrics.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    _add_docs(app, auth, public=not api.tokens)
    return app


def _telemetry() -> dict:
    """FastAPI's own tracing (0.142 and later: a span per HTTP request, the trace's root, while a tracer provider is
    installed) leaves out what specmesh.tracing.http_excluded does: probes and scrapes, by default."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}  # an older FastAPI makes no span of its own
    return {"telemetry": {"exclude": tracing.http_excluded()}}


def _request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI description of a route that reads its body itself (read_body)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _add_docs(app: FastAPI, auth: list, public: bool) -> None:
    """/openapi.json (behind the token when there is one) and, only when the API is public, /docs and /redoc."""
    schema: dict = {}

    def openapi() -> dict:
        if not schema:
            schema.update(get_openapi(title=app.title, version=app.version, description=app.description,
                                      routes=app.routes))
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return schema

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi())

    if public:
        @app.get("/docs", include_in_schema=False)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

        @app.get("/redoc", include_in_schema=False)
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
