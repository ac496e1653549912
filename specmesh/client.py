"""The specmesh client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for `specmesh serve`.

    from specmesh.client import Client
    with Client("127.0.0.1:50050") as client:
        for chunk in client.stream("def fibonacci(n):", max_new_tokens=64):
            print(chunk.text, end="")
        print(client.generate("import os", max_new_tokens=32).stats["tau"])

Imports neither torch nor any model code. Calls carry the bearer token (argument,
``token_file`` or $SPECMESH_TOKEN) and optional TLS; the unary ``generate`` is
retried by gRPC on UNAVAILABLE (service-config retry policy), as is a stream that
has not yet received anything. Leaving a ``stream`` loop early cancels the
request on the server, which frees its KV cache and drafter session.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specmesh import rpc
from specmesh.contract import TokenLogprobs
from specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specmesh.wire import logprobs_from_proto

__all__ = ["AsyncClient", "Chunk", "Client", "Completion", "StepInfo"]
_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


@dataclass(frozen=True)
class StepInfo:
    """One speculative step: how much was proposed and accepted, and where the time went."""

    num_proposed: int
    tree_depth: int
    num_accepted: int
    accepted_sources: tuple[str, ...]
    draft_ms: float
    verify_ms: float
    draft_error: str
    budget: tuple[int, int] = (0, 0)  # (max_nodes, max_depth) the server's policy chose
    predrafted: bool = False  # drafted while the previous step was verified (PEARL overlap)
    wait_ms: float = 0.0  # time the verifier waited for this step's tree
    step_ms: float = 0.0  # wall time of the step in the server
    drafter_busy_ms: float = 0.0  # time the drafter worked during the step
    predraft_nodes: int = 0  # nodes drafted ahead during this step's verification
    predraft_used: int = 0  # of those, nodes the next step verified
    proposed_per_source: tuple[tuple[str, int], ...] = ()  # (proposer, nodes proposed), sorted by name


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    step: StepInfo | None  # None for the first token (from the prefill) and the final chunk
    finish_reason: str  # "" until the last chunk: then "stop" | "length"
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked (``logprobs=k``)


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)  # tau, tokens_per_second, acceptance_per_position, ...
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked (``logprobs=k``)


def _request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    lark: str | None = None,
    proposer: str | None = None,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    overlap: bool | None = None,
    policy: str | None = None,
    restart_depth: int | None = None,
    mjsd_threshold: float | None = None,
) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, stop=list(stop),
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, mjsd_threshold=mjsd_threshold or 0.0,
        include_stop_str_in_output=include_stop_str_in_output, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logit_bias=dict(logit_bias or {}),
    )
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    grammars = [(kind, spec) for kind, spec in (
        ("json_schema", json_schema if json_schema is None or isinstance(json_schema, str) else json.dumps(json_schema)),
        ("json_object", "" if json_object else None), ("regex", regex), ("lark", lark)) if spec is not None]
    if len(grammars) > 1:
        raise ValueError("ask for one structured output: json_schema, json_object, regex or lark")
    if grammars:
        sampling.grammar_kind, sampling.grammar = grammars[0]
    request = generate_pb2.GenerateRequest(sampling=sampling)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    if proposer is not None:
        request.spec.proposer = proposer
    if max_nodes is not None:  # each unset size takes the proposer's default
        request.spec.budget.max_nodes = max_nodes
    if max_depth is not None:
        request.spec.budget.max_depth = max_depth
    if overlap is not None:
        request.spec.overlap = overlap
    if policy is not None:
        request.spec.policy = policy
    if restart_depth is not None:
        request.spec.restart_depth = restart_depth
    return request


def _chunk(msg: generate_pb2.GenerateChunk) -> Chunk:
    step = None
    if msg.HasField("step"):
        s = msg.step
        step = StepInfo(s.num_proposed, s.tree_depth, s.num_accepted, tuple(s.accepted_sources), s.draft_ms,
                        s.verify_ms, s.draft_error, (s.budget_nodes, s.budget_depth), s.predrafted, s.wait_ms,
                        s.step_ms, s.drafter_busy_ms, s.predraft_nodes, s.predraft_used,
                        tuple(sorted(s.proposed_per_source.items())))
    logprobs = logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None
    return Chunk(tuple(msg.token_ids), msg.text, step, msg.finish_reason, logprobs)


def _completion(msg: generate_pb2.GenerateResponse) -> Completion:
    s = msg.stats
    stats = {
        "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens, "steps": s.steps, "tau": s.tau,
        "tokens_per_second": s.tokens_per_second, "total_seconds": s.total_seconds,
        "acceptance_per_position": list(s.acceptance_per_position), "draft_errors": s.draft_errors,
        "acceptance": s.acceptance or "exact", "lossy": s.lossy,
    }
    logprobs = logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None
    return Completion(list(msg.token_ids), msg.text, msg.finish_reason, stats, logprobs)


class _Base:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        aio: bool = False,
    ) -> None:
        """``timeout``: default deadline in seconds of each call (None = none); TLS is used when
        ``tls_ca`` is given (``tls_cert``/``tls_key`` = client certificate for mutual TLS).
        ``wait_for_ready``: a call with a deadline waits within it for a server that is not up yet (gRPC
        wait-for-ready) instead of failing at once with UNAVAILABLE; off by default, so a server that is
        down or refuses the credentials is reported at once. ``wait_ready`` waits explicitly."""
        self.address = address
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self._security = rpc.Security.load(token, token_file, tls_cert, tls_key, tls_ca)
        options = rpc.channel_options([(_SERVICE, "Generate"), (_SERVICE, "GenerateStream")])
        self._channel = rpc.insecure_or_secure_channel(address, self._security, options, aio=aio)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)
        self._metadata = self._security.metadata()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _call_options(self, timeout: float | None) -> dict:
        timeout = self._timeout(timeout)
        return dict(timeout=timeout, metadata=self._metadata, wait_for_ready=self.wait_for_ready and timeout is not None)


class Client(_Base):
    """Blocking client of `specmesh serve`. Errors are ``grpc.RpcError`` with the server's status code."""

    def __init__(self, address: str, **kwargs) -> None:
        super().__init__(address, **kwargs)

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, **params) -> Iterator[Chunk]:
        """Chunks as the server commits tokens; params as ``generate``."""
        call = self._stub.GenerateStream(_request(prompt, **params), **self._call_options(timeout))
        try:
            for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()  # no-op when finished; frees the server's session when the caller stops early

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **params) -> Completion:
        """Text (str) or token-id prompt. params: max_new_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, include_stop_str_in_output (a matched stop string ends the text instead of being
        cut), presence_penalty, frequency_penalty (OpenAI's), repetition_penalty (CTRL's), logit_bias ({token id:
        value}), logprobs (k: each token's log-probability and its k most likely alternatives, in the result's and
        each chunk's ``logprobs``), structured output (one of json_schema (a dict or its JSON text), json_object=True,
        regex, lark (a Lark grammar): the output is the target's own under the grammar's mask), proposer ("none" = plain decoding; "mjsd" = LOSSY, greedy only), max_nodes,
        max_depth, overlap (PEARL on/off), policy ("static" | "adaptive"), restart_depth and mjsd_threshold
        (proposer mjsd only); unset = the server's defaults. ``stats["lossy"]``: whether the output may differ
        from the target's own decoding."""
        msg = self._stub.Generate(_request(prompt, **params), **self._call_options(timeout))
        return _completion(msg)

    def wait_ready(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the server to accept connections (e.g. while it starts);
        TimeoutError otherwise."""
        import grpc

        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"no server ready at {self.address} within {timeout:g} s") from None

    def health(self, timeout: float = 5.0) -> str:
        """The server's health status name: SERVING, NOT_SERVING, ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        response = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client of `specmesh serve`; same methods as ``Client``, awaited."""

    def __init__(self, address: str, **kwargs) -> None:
        super().__init__(address, aio=True, **kwargs)

    async def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                     **params) -> AsyncIterator[Chunk]:
        call = self._stub.GenerateStream(_request(prompt, **params), **self._call_options(timeout))
        try:
            async for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **params) -> Completion:
        msg = await self._stub.Generate(_request(prompt, **params), **self._call_options(timeout))
        return _completion(msg)

    async def wait_ready(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the server to accept connections; TimeoutError otherwise."""
        import asyncio

        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no server ready at {self.address} within {timeout:g} s") from None

    async def health(self, timeout: float = 5.0) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        response = await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(),
                                                                         timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
