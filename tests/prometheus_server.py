"""A real Prometheus server for tests: Debian's `prometheus` package (2.42 here), started on a free loopback
port with a temporary config and TSDB, scraping the given targets (fixed, or from file_sd files) every second,
stopped when the context ends. Where the binary is absent (CI may not have it) the test skips, saying how to
install it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from service_helpers import wait_until

START_TIMEOUT_S = 20.0


def prometheus_binary() -> str:
    """The `prometheus` executable; skips the test where there is none."""
    found = shutil.which("prometheus") or (Path("/usr/bin/prometheus").is_file() and "/usr/bin/prometheus")
    if not found:
        pytest.skip("prometheus binary not installed: apt-get install prometheus")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """A running server's HTTP API (``/api/v1/...``)."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def api(self, path: str, **params: str):
        """``data`` of GET /api/v1/``path``; AssertionError unless the status is success."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant vector: [{"metric": labels, "value": [time, "value"]}]."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """A range of ``expr`` (Unix seconds): [{"metric": labels, "values": [[time, "value"], ...]}]."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def wait_for(self, condition: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> bool:
        return wait_until(condition, timeout, interval=0.25)


@contextmanager
def prometheus_server(tmp_path: Path, jobs: Mapping[str, Sequence[str]],
                      file_jobs: Mapping[str, Path] | None = None) -> Iterator[Prometheus]:
    """A Prometheus scraping ``jobs`` (job name -> ``host:port`` targets, path /metrics) every second, and the
    targets of ``file_jobs`` (job name -> a file_sd JSON file, re-read when it changes; its labels kept over the
    scraped ones, ``honor_labels``, as deploy/monitoring/prometheus/prometheus.yml does), its TSDB in
    ``tmp_path``; stopped (terminated, then killed) when the block ends."""
    binary = prometheus_binary()
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}
                                 for job, targets in jobs.items()]
              + [{"job_name": job, "honor_labels": True,
                  "file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}]}
                 for job, path in (file_jobs or {}).items()]}
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    port = _free_port()
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited: {log.read_text()}"
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False

        assert server.wait_for(ready), f"prometheus not ready after {START_TIMEOUT_S} s: {log.read_text()}"
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
