"""Real specmesh servers as separate processes on 127.0.0.1, for the service tests.

Processes are specmesh_app.local_mesh.ServiceProcess: port 0 reported through
--ready-file, SIGKILL when the test process dies, every wait bounded.
"""

from __future__ import annotations

import time

import grpc

from specmesh.models import demo_model
from specmesh_app.local_mesh import ServiceProcess

TARGET = str(demo_model("target"))
DRAFT = str(demo_model("draft"))
# float64 everywhere: rounding can never flip an argmax between tree and chain forwards
TARGET_ARGS = ["--target", TARGET, "--dtype", "float64", "--threads", "1"]
DRAFT_ARGS = ["--draft", DRAFT, "--draft-dtype", "float64", "--threads", "1"]


Service = ServiceProcess


def verifier(*extra: str, env=None, listen: str = "127.0.0.1:0") -> Service:
    return Service(["-m", "specmesh", "verifier", *TARGET_ARGS, *extra], env, "verifier", listen)


def drafter(*extra: str, env=None, module: str = "specmesh", listen: str = "127.0.0.1:0") -> Service:
    return Service(["-m", module, "drafter", *DRAFT_ARGS, *extra], env, "drafter", listen)


def serve(verifiers: list[Service], drafters: list[Service], *extra: str, env=None) -> Service:
    argv = ["-m", "specmesh", "serve", "--tokenizer", TARGET]
    argv += [a for v in verifiers for a in ("--verifier", v.address)]
    argv += [a for d in drafters for a in ("--drafter", d.address)]
    return Service([*argv, *extra], env, "serve")


def start_all(*services: Service) -> list[Service]:
    """Wait for services started together (they boot in parallel)."""
    for s in services:
        s.wait_ready()
    return list(services)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def channel(service: Service) -> grpc.Channel:
    return grpc.insecure_channel(service.address)


def verifier_sessions(service: Service) -> int:
    """Sessions holding a KV cache on a verifier, from its Info RPC."""
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

    return verifier_pb2_grpc.VerifierStub(channel(service)).Info(verifier_pb2.InfoRequest(), timeout=5).num_sessions


def drafter_sessions(service: Service) -> int:
    """Open sessions on a drafter, from its Info RPC."""
    from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

    stub = drafter_pb2_grpc.DrafterStub(channel(service))
    return stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5).num_sessions
