"""An OTLP/gRPC trace receiver for the tests: the collector protocol's TraceService on a free loopback port,
keeping every span it is sent (opentelemetry-proto's service definitions, no collector binary)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SPAN_KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict = field(hash=False)
    status_code: int  # 0 unset, 1 ok, 2 error
    events: tuple[str, ...] = ()


def any_value(value):
    """An OTLP AnyValue as Python: arrays become tuples, key-value lists dicts."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes; ``spans()`` what arrived so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self._server = grpc.server(ThreadPoolExecutor(4, thread_name_prefix="otlp-receiver"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        kind=SPAN_KINDS.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes={kv.key: any_value(kv.value) for kv in s.attributes},
                        status_code=s.status.code, events=tuple(e.name for e in s.events),
                    ))
        with self._lock:
            self._spans += received
            self.num_exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def stop(self) -> None:
        self._server.stop(0)
