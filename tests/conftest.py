"""Fixtures: tiny random Llama target/draft models (float64, fixed seeds), runners, AR references."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The suite forks server processes (local_mesh.ServiceProcess: preexec_fn, so a real fork) from a process
# whose gRPC clients have run. With gRPC's fork support on, the child restarts gRPC's poller between fork and
# exec and can abort on a closed epoll fd (grpc/grpc#43055; seen here as "drafter exited with -6"). The
# children exec at once and never use the parent's gRPC state, so the suite runs without fork support.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# a local Ray cluster stays on 127.0.0.1: Ray 2.60 swaps loopback for the interface's address without this
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# not ./.hypothesis; removed when the run ends (every run made one more /tmp/specmesh-hypothesis-* before)
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="specmesh-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)

# no example database on disk (nothing written outside tests/), no wall-clock deadlines on a busy box
settings.register_profile("specmesh", database=None, deadline=None)
# `pytest --hypothesis-profile stress` (DEVELOPERS.md): 50x the examples, to hunt a property's rare counterexample
settings.register_profile("stress", settings.get_profile("specmesh"), max_examples=5000)
settings.load_profile("specmesh")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `pytest` without -m
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a GPU the Triton kernels' tests run under the interpreter, on CPU tensors. Triton reads
# TRITON_INTERPRET when it is first imported (its own library functions are @triton.jit too), and
# importing transformers (spec_helpers) imports it: set it first. `import torch` alone imports no triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spec_helpers import build_model_set, engine_for, greedy  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()  # the kernel tests' interpreter patches triton.language once per launch

# The modules of this suite run tiny models, where extra intra-op threads only spin against each
# other and against other processes (up to 100x slower on a busy 2-core machine). Other test files
# (e.g. training) keep torch's default.
SINGLE_THREAD_MODULES = {
    "test_draft_model", "test_engine_faults", "test_greedy_equivalence", "test_kv_cache", "test_prompt_lookup",
    "test_sampling_distribution", "test_stats", "test_stopping", "test_tree", "test_grpc_services",
    "test_grpc_faults", "test_grpc_fuzz", "test_grpc_security", "test_drafter_link", "test_batched_verification",
    "test_verifier_feedback", "test_falcon", "test_falcon_grpc",
}


# Under pytest-xdist (`-n N`) the machine's cores are shared by N workers: each worker, and every server process
# it spawns (they inherit the environment), gets its share of intra-op threads instead of torch's default of
# one per core, which on 2 cores with 2 workers oversubscribes them 2x and makes tiny-model steps spin.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Modules whose module-scoped fixtures start server processes (a mesh, a Redis, an HTTP server): under xdist their
# tests run on one worker, so the servers start once, not once per worker. The session's `mesh` likewise.
SERVER_MODULES = {
    "test_falcon_grpc", "test_grpc_faults", "test_grpc_security", "test_http_api", "test_http_hardening",
    "test_metrics_services", "test_retrieval", "test_tracing",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (pyproject's addopts): the tests that start a local Ray cluster run on one worker,
    one after another (two clusters at once on 2 cores starve each other's raylets and Serve's health checks); the
    tests of a module with its own servers, and those of the session's mesh, run on one worker each. The slow
    tests are handed out first (xdist deals groups by size, then in collection order), so that none starts last and
    leaves the other workers idle while it runs."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "mesh" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("mesh"))
        elif module in SERVER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the slow ones first


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in SINGLE_THREAD_MODULES:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_sets():
    """kind -> ModelSet; "random": a plain random target, "cyclic": a target whose greedy text loops."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = build_model_set(kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def ar_reference(model_sets):
    """Memoised plain autoregressive greedy output of the Engine (drafter=None)."""
    memo: dict = {}

    def get(kind: str, backend: str, prompt, max_new_tokens: int) -> list[int]:
        key = (kind, backend, tuple(prompt), max_new_tokens)
        if key not in memo:
            runner = model_sets(kind).runner("target", backend)
            memo[key] = engine_for(runner).generate(list(prompt), greedy(max_new_tokens)).token_ids
        return memo[key]

    return get


@pytest.fixture(scope="session")
def mesh():
    """A running disaggregated deployment: one verifier, two drafters, one `serve` (separate processes)."""
    import service_helpers as sh

    services = []
    try:
        v = sh.verifier("--feedback-topk", "8")  # top-k rows for token recycling (also inside fused)
        d1, d2 = sh.drafter(), sh.drafter()
        services += [v, d1, d2]
        sh.start_all(v, d1, d2)
        s = sh.serve([v], [d1, d2])
        services.append(s)
        s.wait_ready()
        yield {"verifier": v, "drafters": [d1, d2], "serve": s}
    finally:
        for svc in services:
            svc.stop()


@pytest.fixture(scope="session")
def demo_stack():
    """The bundled demo pair in float64, in this process: the embedded reference for the service tests."""
    import service_helpers as sh

    from orchestrator.embedded import EmbeddedStack

    return EmbeddedStack.load(sh.TARGET, sh.DRAFT, torch.float64, torch.float64)
