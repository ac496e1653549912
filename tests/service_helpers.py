"""Real specmesh servers as separate processes on 127.0.0.1, for the service tests.

Each server binds port 0 and reports its port through --ready-file. Children get
SIGKILL when the test process dies (PR_SET_PDEATHSIG), and every wait is bounded,
so nothing outlives or hangs the suite.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specmesh.cli import demo_model

TARGET = str(demo_model("target"))
DRAFT = str(demo_model("draft"))
# float64 everywhere: rounding can never flip an argmax between tree and chain forwards
TARGET_ARGS = ["--target", TARGET, "--dtype", "float64", "--threads", "1"]
DRAFT_ARGS = ["--draft", DRAFT, "--draft-dtype", "float64", "--threads", "1"]
START_TIMEOUT = 90.0


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Service:
    """One server process. ``address`` is 127.0.0.1:<port> once started."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, name: str = "") -> None:
        self.name = name or argv[0]
        self._dir = tempfile.TemporaryDirectory(prefix="specmesh-svc-")
        self.ready = Path(self._dir.name) / "port"
        self.log = Path(self._dir.name) / "log"
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *argv, "--listen", "127.0.0.1:0", "--ready-file", str(self.ready)],
                stdout=log, stderr=subprocess.STDOUT, env=full_env, preexec_fn=_die_with_parent,
            )
        self.port = 0

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Service:
        end = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > end:
                self.kill()
                raise TimeoutError(f"{self.name} not ready within {timeout} s:\n{self.log_text()}")
            time.sleep(0.05)
        self.port = int(self.ready.read_text())
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        self.kill()
        self._dir.cleanup()


def verifier(*extra: str, env=None) -> Service:
    return Service(["-m", "specmesh", "verifier", *TARGET_ARGS, *extra], env, "verifier")


def drafter(*extra: str, env=None, module: str = "specmesh") -> Service:
    return Service(["-m", module, "drafter", *DRAFT_ARGS, *extra], env, "drafter")


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
