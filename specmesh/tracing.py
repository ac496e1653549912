"""OpenTelemetry tracing: off unless the standard ``OTEL_*`` variables ask for it.

Only the OpenTelemetry API is imported here (a core dependency, and a no-op until an SDK is
installed); the SDK, the OTLP exporter and the gRPC instrumentation (the ``otel`` extra) are
imported by ``setup_tracing`` when tracing is asked for:

- ``OTEL_TRACES_EXPORTER`` naming an exporter (``otlp``, ``console``; ``none`` = off), or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (then ``otlp``);
  ``OTEL_SDK_DISABLED=true`` wins over both;
- OTLP over gRPC unless ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL=http/protobuf`` (the http exporter,
  if installed); every other ``OTEL_*`` setting (headers, TLS, sampler, batch delay, resource
  attributes, service name) is read by the SDK itself.

Once set up, every gRPC server (``rpc.new_server``) and channel (``rpc.insecure_or_secure_channel``)
of this process gets the instrumentation package's interceptors, which propagate W3C trace context in
the call metadata, so the spans of serve, verifier and drafter join one trace per request. Reflection is not
traced, and neither are probes (``setup_tracing(trace_probes=True)`` traces them): gRPC health checks, and the HTTP
port's scrapes and probes (``PROBE_PATHS``), which FastAPI (0.142 or later) would give a trace each: ``http_excluded``
is its ``exclude``, replaced by OpenTelemetry's ``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS``
where one is set. Without tracing no interceptor is added.

Spans of our own (``span``): the request (``request_span``, GenAI semantic conventions), its prefill
and speculative steps (``orchestrator/tracing_steps.py``), the drafter's proposals. While tracing is
off they are the API's non-recording spans (about a microsecond each).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext

from opentelemetry import propagate, trace

from specmesh import package_version

log = logging.getLogger("specmesh.tracing")

INSTRUMENTATION_NAME = "specmesh"
PROVIDER = "specmesh"  # gen_ai.provider.name / gen_ai.system
EXTRA_HINT = "pip install 'specmesh[otel]'"
_EXPORTERS = ("otlp", "console")
_UNTRACED_SERVICES = ("grpc.reflection.",)  # tooling, not requests
_PROBE_SERVICES = ("grpc.health.",)  # probes: untraced unless trace_probes
# the HTTP port's scrapes and probes (orchestrator/http_api.py): a Prometheus scrape, a kubelet's probes, a router's
# /load poll every few seconds would outnumber the requests' traces
PROBE_PATHS = frozenset({"/metrics", "/health", "/readyz", "/livez", "/load"})
# OpenTelemetry's variables for the URLs an HTTP instrumentation leaves untraced (opentelemetry-util-http's
# get_excluded_urls("FASTAPI")): the FastAPI one first, then the one for every instrumentation
EXCLUDED_URLS_ENV = ("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", "OTEL_PYTHON_EXCLUDED_URLS")
# one call for many requests: each item carries its request's trace context and is a span of that trace
_UNTRACED_METHODS = ("specmesh.v1.Verifier/VerifyBatch",)

_enabled = False  # setup_tracing installed the SDK in this process
_untraced_services = _UNTRACED_SERVICES + _PROBE_SERVICES  # the gRPC services no span is made for
_trace_probes = False  # setup_tracing(trace_probes=True): health checks and HTTP probes are traced too
_NO_SPAN = nullcontext(trace.INVALID_SPAN)  # what ``span`` is while no provider is installed
_tracer_cache: tuple[object, trace.Tracer] | None = None  # (provider, its tracer)


class TracingSetupError(RuntimeError):
    """Tracing is asked for by the environment but cannot be set up (extra missing, bad settings)."""


# ------------------------------------------------------------------ setup
def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def requested_exporters(environ: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters the standard variables ask for; [] = tracing off."""
    env = os.environ if environ is None else environ
    if _is_true(env.get("OTEL_SDK_DISABLED")):
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    return [n for n in names if n != "none"]


def enabled() -> bool:
    """``setup_tracing`` set tracing up in this process."""
    return _enabled


def setup_tracing(service_name: str, trace_probes: bool = False) -> bool:
    """Install an SDK tracer provider exporting this process's spans, if the ``OTEL_*`` variables ask for it
    (see the module docstring); True if tracing is on. Call it before creating any gRPC server or channel.
    ``service_name``: the ``service.name`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` set
    one; ``trace_probes``: trace health checks and the HTTP port's probes and scrapes as well. Spans are batched
    (``OTEL_BSP_*``) and flushed when the process exits. TracingSetupError when tracing is asked for but cannot
    be had."""
    global _enabled, _trace_probes, _untraced_services
    _trace_probes = trace_probes
    _untraced_services = _UNTRACED_SERVICES + (() if trace_probes else _PROBE_SERVICES)
    if _enabled:
        return True
    names = requested_exporters()
    if not names:
        return False
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise TracingSetupError(f"OTEL_TRACES_EXPORTER={os.environ.get('OTEL_TRACES_EXPORTER')}: specmesh exports "
                                f"spans with {', '.join(_EXPORTERS)} (or none)")
    try:
        import opentelemetry.instrumentation.grpc  # noqa: F401  (the interceptors, needed once tracing is on)
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise TracingSetupError(f"tracing is asked for by the OTEL_* environment variables, but the OpenTelemetry "
                                f"SDK is not installed ({exc.name or exc}): {EXTRA_HINT}") from None
    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    if SERVICE_VERSION not in resource.attributes:
        resource = resource.merge(Resource({SERVICE_VERSION: package_version() or "unknown"}))
    exporters = [_otlp_exporter() if n == "otlp" else ConsoleSpanExporter() for n in names]
    provider = TracerProvider(resource=resource)  # shuts down (flushing every processor) at exit
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on: %s spans of %s", "+".join(names), resource.attributes.get(SERVICE_NAME))
    return True


def _otlp_exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingSetupError(f"the OTLP gRPC exporter is not installed ({exc.name or exc}): "
                                    f"{EXTRA_HINT}") from None
        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingSetupError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs the OTLP http exporter: pip "
                                    "install opentelemetry-exporter-otlp-proto-http (or use grpc, which "
                                    f"{EXTRA_HINT} brings)") from None
        return OTLPSpanExporter()
    raise TracingSetupError(f"OTLP protocol {protocol!r} is not supported: use grpc or http/protobuf")


# ------------------------------------------------------------ gRPC propagation
def _traced_call(details) -> bool:
    """The interceptors' filter: every call but health checks (unless trace_probes), reflection and VerifyBatch. (The
    instrumentation's own ``filters.service_prefix`` costs ~25 us a check: it tests the details against typing
    Protocols.)"""
    method = getattr(details, "full_method", None) or getattr(details, "method", "")  # client / server details
    if isinstance(method, bytes):
        method = method.decode()
    method = method.lstrip("/")
    return not (method.startswith(_untraced_services) or method in _UNTRACED_METHODS)


# ------------------------------------------------------------------ HTTP
def http_excluded(environ: Mapping[str, str] | None = None) -> Callable[[Mapping], bool] | None:
    """FastAPI's telemetry ``exclude`` for the HTTP port: given a request's ASGI scope, True = no span. Where
    ``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS`` (else ``OTEL_PYTHON_EXCLUDED_URLS``) is set, its comma-separated regular
    expressions, each searched for in the request's URL, decide, as in OpenTelemetry's own HTTP instrumentations
    (opentelemetry-util-http's ExcludeList; set empty, nothing is excluded); otherwise the probe paths
    (``PROBE_PATHS``) are, unless ``setup_tracing`` was asked to trace probes. None: nothing is excluded."""
    env = os.environ if environ is None else environ
    for name in EXCLUDED_URLS_ENV:
        if name in env:
            patterns = [p.strip() for p in env[name].split(",") if p.strip()]
            if not patterns:
                return None
            excluded = re.compile("|".join(patterns))
            return lambda scope: excluded.search(_url(scope)) is not None
    if _trace_probes:
        return None
    return lambda scope: scope.get("path", "").removeprefix(scope.get("root_path", "")) in PROBE_PATHS


def _url(scope: Mapping) -> str:
    """The URL OpenTelemetry's ASGI middleware matches excluded URLs against: scheme, server, path (which holds the
    root path), no query."""
    host, port = scope.get("server") or ("0.0.0.0", 80)
    server = host if str(port) == "80" else f"{host}:{port}"
    return f"{scope.get('scheme', 'http')}://{server}{scope.get('path', '')}"


def server_interceptors() -> list:
    """Interceptors for a ``grpc.aio`` server: the one that continues the caller's trace (W3C trace context in
    the metadata) in a server span per call; none while tracing is off."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_traced_call)]


def intercept_channel(channel):
    """A synchronous channel whose calls open client spans and carry the trace context; ``channel`` itself
    while tracing is off."""
    if not _enabled:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel as intercept

    return intercept(channel, client_interceptor(filter_=_traced_call))


def aio_channel_interceptors() -> list:
    """Interceptors for a ``grpc.aio`` channel, as ``intercept_channel``; none while tracing is off."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(filter_=_traced_call)


# ------------------------------------------------------------------ spans
def tracer() -> trace.Tracer:
    """specmesh's tracer from the global provider (re-fetched when the provider changes)."""
    global _tracer_cache
    provider = trace.get_tracer_provider()
    cache = _tracer_cache
    if cache is None or cache[0] is not provider:
        cache = _tracer_cache = (provider, provider.get_tracer(INSTRUMENTATION_NAME))
    return cache[1]


def span(name: str, attributes: Mapping[str, object] | None = None):
    """A context manager: a span child of the current one, current inside the block, ended at its end (an
    exception is recorded and sets the error status). Never hold it across a generator's ``yield``. With no
    tracer provider installed it is a shared no-op yielding the API's invalid span (well under a microsecond)."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return _NO_SPAN
    return tracer().start_as_current_span(name, attributes=attributes)


def current_span() -> trace.Span:
    """The span of the current context (the RPC's server span inside a traced handler); non-recording when
    there is none."""
    return trace.get_current_span()


def attributes(prefix: str, values: Mapping[str, object]) -> dict[str, object]:
    """``values`` as span attributes named ``prefix + key``: numbers, strings and booleans as they are,
    lists of one of those as arrays, mappings flattened with dots; anything else is left out."""
    out: dict[str, object] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(attributes(name + ".", value))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value) \
                and not any(isinstance(v, bool) for v in value):
            out[name] = [float(v) for v in value] if any(isinstance(v, float) for v in value) else list(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            out[name] = list(value)
    return out


def request_attributes(model: str, operation: str, sampling, prompt_tokens: int) -> dict[str, object]:
    """A generation request's span attributes (GenAI semantic conventions; ``sampling``: its SamplingParams)."""
    attrs: dict[str, object] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,  # the older name of gen_ai.provider.name, which backends still read
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_new_tokens,
        "gen_ai.request.temperature": float(sampling.temperature),
        "gen_ai.request.top_p": float(sampling.top_p),
        "gen_ai.usage.input_tokens": prompt_tokens,
    }
    if sampling.top_k:
        attrs["gen_ai.request.top_k"] = float(sampling.top_k)
    if sampling.seed is not None:
        attrs["gen_ai.request.seed"] = sampling.seed
    if sampling.stop:
        attrs["gen_ai.request.stop_sequences"] = list(sampling.stop)
    return attrs


@contextmanager
def request_span(operation: str, model: str, sampling, prompt_tokens: int) -> Iterator[trace.Span]:
    """The span of one generation request, named ``"{operation} {model}"`` after the GenAI semantic
    conventions (``operation``: ``text_completion`` or ``chat``; ``sampling``: its SamplingParams), current
    inside the block: open it on the thread that runs the engine, around ``Engine.stream``, and end the
    request with ``record_request_result``. Yields a non-recording span while tracing is off."""
    with span(f"{operation} {model}", request_attributes(model, operation, sampling, prompt_tokens)) as request:
        yield request


def start_request_span(operation: str, model: str, sampling, prompt_tokens: int) -> trace.Span:
    """``request_span`` for a request that no thread runs (an engine core steps it): a child of the current span,
    not made current; end it with ``.end()``. Non-recording while tracing is off."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return trace.INVALID_SPAN
    return tracer().start_span(f"{operation} {model}", attributes=request_attributes(model, operation, sampling,
                                                                                      prompt_tokens))


def start_child(parent: trace.Span, name: str, attributes: Mapping[str, object] | None = None,
                start_ns: int | None = None) -> trace.Span:
    """A span under ``parent``, started (at ``start_ns``, ``time.time_ns()``, or now) and not made current; end it
    with ``.end()``. The API's non-recording span while ``parent`` does not record."""
    if not parent.is_recording():
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=trace.set_span_in_context(parent), attributes=attributes,
                               start_time=start_ns)


def carrier() -> dict[str, str]:
    """The current span's W3C trace context (traceparent, tracestate) for a message to carry, as the gRPC
    interceptors carry it in metadata (a VerifyBatch item's ``trace_context``: one call serves many requests'
    traces); empty while nothing records."""
    if not trace.get_current_span().is_recording():
        return {}
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def remote_span(carried: Mapping[str, str], name: str, start_ns: int | None = None,
                attributes: Mapping[str, object] | None = None) -> trace.Span:
    """A server span continuing the trace a message carried (``carrier``), started at ``start_ns`` (or now) and
    not made current; end it with ``.end()``. The API's non-recording span while nothing was carried or no
    tracer provider is installed here."""
    if not carried or isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=propagate.extract(carried), kind=trace.SpanKind.SERVER,
                               attributes=attributes, start_time=start_ns)


def use(span: trace.Span | None):
    """A context manager making ``span`` current inside the block without ending it (the calls made there are its
    children: a gRPC call's client span, a drafter call copied to a worker); nothing when it is None or does not
    record."""
    if span is None or not span.is_recording():
        return nullcontext()
    return trace.use_span(span, end_on_exit=False)


def record_error(span: trace.Span, exc: BaseException) -> None:
    """What ``span``'s context manager does with an exception, for a span ended by hand."""
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def child_span(parent: trace.Span, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, object]) -> None:
    """A finished span under ``parent`` (not current anywhere) from ``start_ns`` to ``end_ns``
    (``time.time_ns()``): a step an engine core ran for the parent's request. Nothing while ``parent`` does not
    record."""
    if not parent.is_recording():
        return
    child = tracer().start_span(name, context=trace.set_span_in_context(parent), attributes=attributes,
                                start_time=start_ns)
    child.end(end_time=end_ns)


def record_request_result(span: trace.Span, finish_reason: str, output_tokens: int, stats_summary: Mapping) -> None:
    """The outcome of a request on its ``request_span``: finish reason, output tokens (GenAI conventions)
    and the speculation summary (``RequestStats.summary()``) as ``specmesh.request.*`` (tau, steps,
    draft_errors, acceptance_per_position, per_source.<proposer>.proposed/accepted, ...)."""
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    span.set_attributes(attributes("specmesh.request.", stats_summary))
