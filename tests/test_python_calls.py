"""The engine core's Python calls per extra request per step stay under a bound (issue 67 (a)), counted as
benchmarks/python_calls.py counts them (its ``measure``), on its 1-layer, 128-wide random Llama (built into a
temporary directory by engine_overhead.build_model: nothing downloaded): plain decoding and a 16-node tree every
step, 1 request against 17 in flight."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine_overhead import build_model
from benchmarks.python_calls import measure
from specmesh.fast_llama import make_runner
from specmesh.models import load_model

# Measured (benchmarks/results/python_calls.md, after): 40.8 (plain) and 95.6 (tree) calls per extra request;
# the bounds are 1.25x that, rounded up, so the shape cannot quietly regress. Issue 67's goal is <= 10 and <= 25:
# tighten these to 2x the goal (20 and 50) once the columnar step lands.
BOUNDS = {"plain": 51, "tree": 120}
PROMPTS = [[(7 * n + 13 * i) % 1000 + 10 for i in range(32)] for n in range(17)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model_dir = build_model(tmp_path_factory.mktemp("python_calls") / "tiny-llama-1x128")
    return make_runner(load_model(model_dir, torch.float32, "cpu"))


@pytest.mark.parametrize("kind", ["plain", "tree"])
def test_python_calls_per_extra_request_stay_bounded(runner, kind):
    result = measure(runner, PROMPTS, tree=kind == "tree", steps=4, warmup=2, kv_cache_gb=0.02)
    calls, top = result["calls_per_extra_request"], list(result["functions"].items())[:10]
    assert calls <= BOUNDS[kind], f"{calls:.1f} calls per extra request (bound {BOUNDS[kind]}); the most: {top}"
