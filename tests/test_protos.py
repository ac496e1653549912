"""The committed generated code matches the protos, and core types survive the wire."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.contract import Budget
from specmesh.sampling import SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from specmesh.v1 import common_pb2
from specmesh.wire import (
    budget_from_proto,
    budget_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    tree_from_proto,
    tree_to_proto,
)

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/specmesh/v1").glob("*.proto"))
    assert protos, "no .proto files found"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specmesh/v1").iterdir())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "specmesh/v1").iterdir()
                       if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert fresh == committed, "generated file set differs: regenerate (see specmesh/v1/__init__.py)"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} is stale: regenerate it"


@st.composite
def trees(draw):
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    probs = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    sources = tuple(draw(st.lists(st.sampled_from(["a", "b", "draft_model"]), min_size=n, max_size=n)))
    tree = TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(probs), sources)
    if n and draw(st.booleans()):  # sparse q: each node's token plus one other id
        ids, vals = [], []
        for t in tokens:
            other = (t + 1) % 100
            ids += [t, other]
            vals += [0.75, 0.25]
        tree = TokenTree(tree.tokens, tree.parents, tree.draft_probs, sources,
                         q_cu=np.arange(0, 2 * n + 1, 2, dtype=np.int64), q_ids=np.asarray(ids, np.int64),
                         q_probs=np.asarray(vals))
    return tree


@settings(max_examples=150, deadline=None)
@given(trees())
def test_tree_round_trips(tree: TokenTree) -> None:
    wire = common_pb2.TokenTree.FromString(tree_to_proto(tree).SerializeToString())
    back = tree_from_proto(wire)
    np.testing.assert_array_equal(back.tokens, tree.tokens)
    np.testing.assert_array_equal(back.parents, tree.parents)
    np.testing.assert_array_equal(back.draft_probs, tree.draft_probs)
    assert back.sources == tree.sources
    assert (back.q_cu is None) == (tree.q_cu is None)
    if tree.q_cu is not None:
        np.testing.assert_array_equal(back.q_cu, tree.q_cu)
        np.testing.assert_array_equal(back.q_ids, tree.q_ids)
        np.testing.assert_array_equal(back.q_probs, tree.q_probs)
    back.validate(100)


@pytest.mark.parametrize(
    "msg",
    [
        common_pb2.TokenTree(tokens=[1, 2], parents=[-1], draft_probs=[1, 1]),
        common_pb2.TokenTree(tokens=[1], parents=[-1], draft_probs=[1], source_names=["a"], sources=[3]),
        common_pb2.TokenTree(tokens=[1, 2], parents=[-1, 0], draft_probs=[1, 1], source_names=["a"], sources=[0]),
    ],
    ids=["ragged", "source-out-of-range", "sources-ragged"],
)
def test_malformed_wire_trees_are_rejected(msg) -> None:
    with pytest.raises(InvalidTreeError):
        tree_from_proto(msg)


def test_wire_tree_is_validated_like_any_tree() -> None:
    tree = tree_from_proto(common_pb2.TokenTree(tokens=[1, 2], parents=[-1, 5], draft_probs=[1, 1]))
    with pytest.raises(InvalidTreeError, match="parent"):
        tree.validate(10)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0, max_new_tokens=7,
                                      stop=("\n\n", "def "), stop_token_ids=(3,), ignore_eos=True,
                                      include_stop_str_in_output=True),
     SamplingParams(temperature=0.5, presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=1.2,
                    logit_bias=((3, -100.0), (9, 2.5)))],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(wire) == params


def test_unset_sampling_fields_mean_defaults_and_bad_values_are_refused() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="temperature"):
        sampling_from_proto(common_pb2.SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_proto(common_pb2.SamplingParams(top_p=1.5))


def test_budget_round_trip_with_relative_deadline() -> None:
    msg = budget_to_proto(Budget(8, 4), timeout_ms=250)
    budget = budget_from_proto(common_pb2.Budget.FromString(msg.SerializeToString()), now=100.0)
    assert (budget.max_nodes, budget.max_depth) == (8, 4)
    assert budget.deadline == pytest.approx(100.25)
    assert budget_from_proto(budget_to_proto(Budget(1, 1)), now=5.0).deadline is None
    with pytest.raises(ValueError, match="timeout_ms must be >= 0"):
        budget_from_proto(budget_to_proto(Budget(1, 1), timeout_ms=-5), now=5.0)
    with pytest.raises(ValueError, match="min_path_prob"):
        budget_from_proto(common_pb2.Budget(max_nodes=1, max_depth=1, min_path_prob=float("nan")), now=5.0)


def test_client_sdk_imports_without_torch():
    """`specmesh.client` must work in a process that has no torch (a thin client machine)."""
    import subprocess
    import sys

    code = ("import sys\nsys.modules['torch'] = None  # any import of torch now fails\n"
            "import specmesh.client as c\nassert c.Client and c.AsyncClient\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
