"""The tree-attention kernel (kernels/tree_attention.py) against its float64 reference, and wired into the runner.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1``);
with CUDA, on the GPU. Every case NaN-fills the cache slots no request owns and points the tables'
padding at a NaN block: a kernel that reads past a request's keys fails the comparison.

- Kernel vs reference on random requests in one launch: trees (chains, stars, deep-and-wide, random;
  1-128 nodes), tree positions already in the cache before the new rows, causal prefill chunks,
  prefixes crossing block boundaries, block sizes 1-32 with shuffled tables, GQA 1/2/4 and MQA, head
  dims 16-128 (and 48, padded), fp32 / fp16 / bf16, large scores.
- Error bound relative to the float64 reference: max |out - ref| <= atol + rtol * |ref| with
  (atol, rtol) = TOLERANCE[dtype]: 3x (fp32, where large scores dominate) to 12x (fp16) the worst error
  measured over these cases and 40 more random launches, far below what a wrong mask, slot or tile
  (errors of order 0.1-1) gives. bf16 leaves room for the GPU's bf16 P @ V, which the interpreter
  computes in fp32.
- The launcher's errors; the bit packing.
- The fast runner with the kernel == with SDPA (logits and caches); the verifier with the kernel,
  many sessions batched with chunked prefills and trees: greedy output == autoregressive greedy.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from spec_helpers import engine_for, greedy, tiny_llama

from specmesh.tree import TokenTree
from verifier_service.lookahead import LookaheadConfig
from verifier_service.verifier import LocalVerifier

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


ta = importlib.import_module("kernels.tree_attention")
if DEVICE == "cpu" and not ta.INTERPRETED:  # tests/conftest.py sets it; triton must not be imported before
    pytest.fail("no GPU and the kernel is not interpreted: set TRITON_INTERPRET=1 before triton is imported",
                pytrace=False)


# ------------------------------------------------------------------------------------ cases
def tree_parents(shape: str, num_nodes: int, rng: random.Random) -> list[int]:
    """Parents (-1 = root, parents[i] < i) of a tree of one of the shapes drafters send."""
    if shape == "chain":
        return list(range(-1, num_nodes - 1))
    if shape == "star":
        return [-1] * num_nodes
    if shape == "deep_wide":  # 4 branches from the root, each a chain with side leaves
        return [-1 if i < 4 else (i - 4 if i % 3 else rng.randrange(i)) for i in range(num_nodes)]
    return [rng.randrange(-1, i) for i in range(num_nodes)]  # random


def ancestors_of(parents: list[int]) -> np.ndarray:
    """[n, n] bool: row i = i and its ancestors."""
    mask = np.zeros((len(parents), len(parents)), bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


@dataclass(frozen=True)
class Request:
    """``num_new`` rows over ``prefix`` cached positions; a tree of ``shape`` over the last ``num_tree``
    positions (its first num_tree - num_new nodes already cached), or causal when shape is None."""

    prefix: int
    num_new: int
    shape: str | None = None
    num_tree: int = 0


@dataclass(frozen=True)
class Config:
    requests: tuple[Request, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    q_scale: float = 1.0


def build(config: Config, seed: int) -> dict:
    """The kernel's arguments for ``config``: a shuffled block pool, NaN wherever no request has a position."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    size = config.block_size
    kv_len = [r.prefix + max(r.num_tree, r.num_new) for r in config.requests]
    blocks = [-(-n // size) for n in kv_len]
    num_blocks = sum(blocks) + 3  # a few spare blocks, and the last one is the tables' padding
    order = list(range(num_blocks - 1))
    rng.shuffle(order)
    poison = num_blocks - 1
    tables = torch.full((len(blocks), max(blocks) + 2), poison, dtype=torch.int32)
    shape = (config.num_kv_heads, num_blocks * size, config.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=config.dtype)
    v_cache = torch.full(shape, float("nan"), dtype=config.dtype)
    rows, words, tree_start = [], [], []
    used = 0
    for r, (req, length) in enumerate(zip(config.requests, kv_len, strict=True)):
        table = order[used : used + blocks[r]]
        used += blocks[r]
        tables[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(length)
        slots = torch.tensor(table)[pos // size] * size + pos % size
        k_cache[:, slots] = torch.randn(shape[0], length, shape[2], generator=gen).to(config.dtype)
        v_cache[:, slots] = torch.randn(shape[0], length, shape[2], generator=gen).to(config.dtype)
        rows.append(req.num_new)
        if req.shape is None:
            tree_start.append(length)
            junk = torch.randint(-(2**31), 2**31 - 1, (req.num_new, 5), generator=gen, dtype=torch.int32)
            words.append(junk)  # a causal request's mask rows are never read
        else:
            tree_start.append(req.prefix)
            anc = ancestors_of(tree_parents(req.shape, req.num_tree, rng))[req.num_tree - req.num_new :]
            packed = ta.pack_tree_mask(torch.from_numpy(anc))
            words.append(torch.nn.functional.pad(packed, (0, 5 - packed.shape[1])))
    total = sum(rows)
    q = torch.randn(config.num_heads, total, config.head_dim, generator=gen) * config.q_scale
    has_tree = any(r.shape is not None for r in config.requests)
    args = dict(
        q=q.to(config.dtype).transpose(0, 1),  # [T, heads, head_dim], strided like the runner's
        k_cache=k_cache, v_cache=v_cache,
        cu_q=torch.tensor(np.cumsum([0, *rows]), dtype=torch.int32),
        kv_len=torch.tensor(kv_len, dtype=torch.int32),
        tree_start=torch.tensor(tree_start, dtype=torch.int32),
        block_tables=tables, block_size=size,
        mask=torch.cat(words) if has_tree else None,
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def check_against_reference(config: Config, seed: int, kv_splits: int = 1) -> None:
    args = build(config, seed)
    out = ta.tree_attention(**args, kv_splits=kv_splits)
    as64 = {k: v.double() if k in ("q", "k_cache", "v_cache") else v for k, v in args.items()}
    ref = ta.tree_attention_reference(**as64)
    assert out.shape == args["q"].shape and out.dtype == config.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "the kernel read a NaN slot (an unused or padded position)"
    atol, rtol = TOLERANCE[config.dtype]
    err = (out.double() - ref).abs()
    bound = atol + rtol * ref.abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio to the bound {(err / bound).max():.3g}"


def _random_requests(rng: random.Random, count: int, max_nodes: int = 128, max_prefix: int = 100) -> tuple:
    requests = []
    for _ in range(count):
        prefix = rng.randrange(max_prefix)
        if rng.random() < 0.3:
            requests.append(Request(prefix, rng.randint(1, 40)))
        else:
            num_tree = rng.randint(1, max_nodes)
            cached = rng.randrange(num_tree) if rng.random() < 0.3 else 0
            shape = rng.choice(["chain", "star", "deep_wide", "random"])
            requests.append(Request(prefix, num_tree - cached, shape, num_tree))
    return tuple(requests)


CASES = {
    # every tree shape, 1-128 nodes, one launch; prefixes crossing blocks
    "trees-gqa2-d64-bs16-fp32": Config(
        (Request(37, 16, "chain", 16), Request(0, 32, "star", 32), Request(95, 64, "deep_wide", 64),
         Request(18, 128, "random", 128), Request(5, 1, "random", 1)), head_dim=64),
    # tree positions already in the cache before the new rows (the drafter's tree steps), beside causal rows
    "cached-tree-gqa4-d32-bs8-fp32": Config(
        (Request(13, 3, "random", 20), Request(40, 1, "chain", 9), Request(7, 30, "deep_wide", 70),
         Request(21, 1), Request(9, 17)), num_heads=8, num_kv_heads=2, block_size=8),
    # prefill: causal chunks only (no bitmask), one of them the first chunk of a prompt
    "prefill-mha-d16-bs32-fp16": Config(
        (Request(0, 100), Request(70, 7), Request(33, 1), Request(64, 64)), num_kv_heads=4, head_dim=16,
        block_size=32, dtype=torch.float16),
    # a full 512-row prefill chunk (the 128-row tiles) beside a tree
    "prefill512-gqa2-d32-bs16-bf16": Config(
        (Request(0, 512), Request(200, 130), Request(77, 33, "random", 33)), dtype=torch.bfloat16),
    "mixed-mqa-d128-bs1-bf16": Config(
        (Request(11, 24, "random", 24), Request(3, 9), Request(25, 6, "star", 6)), num_kv_heads=1, head_dim=128,
        block_size=1, dtype=torch.bfloat16),
    "mixed-gqa2-d48pad-bs8-fp16": Config(
        (Request(50, 12, "deep_wide", 12), Request(8, 20)), head_dim=48, block_size=8, dtype=torch.float16),
    "large-scores-gqa4-d64-bs16-fp32": Config(
        (Request(60, 40, "random", 40), Request(30, 20)), num_kv_heads=1, head_dim=64, q_scale=12.0),
    "random-gqa2-d64-bs16-bf16": Config(_random_requests(random.Random(5), 4), head_dim=64, dtype=torch.bfloat16),
}


# ------------------------------------------------------------------------------ kernel tests
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference(name):
    check_against_reference(CASES[name], seed=len(name))


def test_kernel_on_random_launches():
    rng = random.Random(0)
    for seed in range(12):
        heads, kv_heads = rng.choice([(4, 4), (4, 2), (8, 2), (4, 1)])
        config = Config(_random_requests(rng, rng.randint(1, 4), max_nodes=128, max_prefix=150), heads, kv_heads,
                        rng.choice([16, 32, 64]), rng.choice([1, 8, 16, 32]),
                        rng.choice([torch.float32, torch.float16, torch.bfloat16]))
        check_against_reference(config, seed)


@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("name", ["trees-gqa2-d64-bs16-fp32", "cached-tree-gqa4-d32-bs8-fp32", "mixed-mqa-d128-bs1-bf16",
                                  "prefill-mha-d16-bs32-fp16"])
def test_split_kv_matches_float64_reference(name, splits):
    """Split-KV (flash-decoding): each tile's keys shared among ``splits`` programs, their states combined; shares
    that get no key (more shares than key tiles) weigh nothing. Same reference, same tolerance."""
    check_against_reference(CASES[name], seed=len(name), kv_splits=splits)


def test_split_kv_on_long_prefixes():
    """Decode rows and a tree over prefixes of hundreds to thousands of keys, where the splits have work each."""
    rng = random.Random(3)
    config = Config((Request(2000, 1), Request(700, 16, "random", 16), Request(1300, 1), Request(90, 5, "star", 5)),
                    num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    for splits in (1, 4, 8):
        check_against_reference(config, seed=rng.randrange(100), kv_splits=splits)
    assert [ta.kv_splits(programs, longest, 132) for programs, longest in
            ((8, 4096), (8, 1000), (200, 8192), (40, 8192), (8, 100_000))] == [8, 1, 1, 4, 16]
    assert ta.kv_splits(8, 4096, None) == 1  # not a GPU: never split


def test_a_row_that_sees_nothing_gets_zeros():
    config = Config((Request(0, 3, "chain", 3),), num_kv_heads=4)
    args = build(config, seed=1)
    args["mask"] = torch.zeros_like(args["mask"])
    out = ta.tree_attention(**args)
    assert out.abs().max() == 0
    torch.testing.assert_close(out, ta.tree_attention_reference(**args))


def test_the_reference_sees_what_the_mask_says():
    """The reference itself, on a case small enough to check by hand: row 1 of a 3-node tree sees its parent."""
    k_cache = torch.eye(4)[None]  # [1, 4 slots, 4]: key j is the unit vector j
    v_cache = torch.arange(16.0).view(1, 4, 4)
    q = torch.zeros(3, 1, 4)  # equal scores: the output is the mean of the visible values
    mask = ta.pack_tree_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = ta.tree_attention_reference(q, k_cache, v_cache, i32(0, 3), i32(4), i32(1), i32(0)[None], 4, mask)
    visible = [[0, 1], [0, 1, 2], [0, 1, 3]]
    torch.testing.assert_close(out[:, 0], torch.stack([v_cache[0, v].mean(0) for v in visible]))


@pytest.mark.parametrize("num_tree", [1, 31, 32, 33, 64, 130])
def test_pack_tree_mask_round_trips(num_tree):
    bits = torch.rand(7, num_tree, generator=torch.Generator().manual_seed(num_tree)) < 0.5
    words = ta.pack_tree_mask(bits)
    assert words.dtype == torch.int32 and words.shape == (7, -(-num_tree // 32))
    assert torch.equal(ta.unpack_tree_mask(words, num_tree), bits)


def _bad(**changes):
    return lambda args: args | {k: (v(args) if callable(v) else v) for k, v in changes.items()}


LAUNCHER_ERRORS = {
    "q not 3-D": (_bad(q=lambda a: a["q"].reshape(a["q"].shape[0], -1)), "must be 3-D"),
    "k/v shapes differ": (_bad(v_cache=lambda a: a["v_cache"][:, :-1]), "differ in shape"),
    "head_dim mismatch": (_bad(q=lambda a: a["q"][..., :16]), "head_dim"),
    "heads not a multiple": (_bad(q=lambda a: a["q"][:, :3]), "evenly"),
    "float64": (_bad(q=lambda a: a["q"].double(), k_cache=lambda a: a["k_cache"].double(),
                     v_cache=lambda a: a["v_cache"].double()), "not supported"),
    "dtypes differ": (_bad(k_cache=lambda a: a["k_cache"].half()), "share a dtype"),
    "int64 metadata": (_bad(kv_len=lambda a: a["kv_len"].long()), "int32"),
    "cu_q length": (_bad(cu_q=lambda a: a["cu_q"][:-1]), r"\[B \+ 1\]"),
    "table rows": (_bad(block_tables=lambda a: a["block_tables"][:1]), "block_tables"),
    "mask rows": (_bad(mask=lambda a: a["mask"][:-1]), "mask must be"),
    "strided table": (_bad(block_tables=lambda a: a["block_tables"].t().contiguous().t()), "unit stride"),
    "block size": (_bad(block_size=0), "block_size"),
}


@pytest.mark.parametrize("name", list(LAUNCHER_ERRORS))
def test_launcher_refuses_what_the_kernel_cannot_read(name):
    mutate, match = LAUNCHER_ERRORS[name]
    args = build(Config((Request(5, 4, "star", 4), Request(3, 2))), seed=0)
    with pytest.raises(ValueError, match=match):
        ta.tree_attention(**mutate(args))


def test_launcher_refuses_tensors_on_two_devices():
    args = build(Config((Request(5, 4, "star", 4),)), seed=0)
    args["cu_q"] = args["cu_q"].to("meta")
    with pytest.raises(ValueError, match="one device"):
        ta.tree_attention(**args)


# ------------------------------------------------------------------------------- the runner
@pytest.fixture(scope="module")
def runners():
    """A tiny float32 Llama (4 heads, 2 KV heads, head_dim 16) behind both attention backends."""
    from specmesh.fast_llama import FastLlamaRunner

    model = tiny_llama(seed=11).float().to(DEVICE)
    # graphs off: these tests count and inspect the eager launches (tests/test_cuda_graphs.py replays them)
    return FastLlamaRunner(model, attention="sdpa"), FastLlamaRunner(model, attention="triton", cuda_graphs="off")


def test_runner_backends(runners, monkeypatch):
    from specmesh.fast_llama import attention_backend

    sdpa, kernel = runners
    assert (sdpa.attention, kernel.attention) == ("sdpa", "triton")
    cpu = torch.device("cpu")
    monkeypatch.delenv("SPECMESH_ATTENTION", raising=False)
    assert attention_backend("auto", cpu, torch.float32) == "sdpa"
    assert attention_backend("auto", torch.device("cuda"), torch.float64) == "sdpa"
    monkeypatch.setenv("SPECMESH_ATTENTION", "triton")
    assert attention_backend("auto", cpu, torch.float32) == "triton"
    assert attention_backend("sdpa", cpu, torch.float32) == "sdpa"  # an explicit choice wins
    with pytest.raises(ValueError, match="unknown attention"):
        attention_backend("flash", cpu, torch.float32)


def _count_launches(monkeypatch) -> list[int]:
    """Rows of every tree_attention launch from now on (the runner calls it through the module)."""
    launches, real = [], ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: launches.append(a[0].shape[0]) or real(*a, **k))
    return launches


def test_runner_with_the_kernel_equals_sdpa(runners, monkeypatch):
    """Prefill chunks and trees (TreeMask) of sessions on a fragmented pool, and one session of its own pool
    (``new_cache``: a growing pool, read through its table):
    the kernel path gives SDPA's logits and writes the same keys/values."""
    from specmesh.model_runner import TreeMask

    launches = _count_launches(monkeypatch)
    rng = random.Random(2)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (37, 5, 1, 20)]
    trees = [tree_parents(shape, n, rng) for shape, n in (("random", 9), ("star", 4), ("chain", 1), ("deep_wide", 12))]
    tokens = [[rng.randrange(128) for _ in t] for t in trees]
    results = []
    for runner in runners:
        pool = runner.new_pool(num_blocks=40, block_size=4)
        pool.allocator.allocate(12)  # a used run first, then tables from the shuffled rest
        caches = [pool.open(len(p) + len(t) + 1) for p, t in zip(prompts, trees, strict=True)]
        single = runner.new_cache()
        logits = [runner.forward_batch(caches, np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]),
                                       [len(p) for p in prompts], [None] * len(prompts))]
        logits.append(runner.forward(single, prompts[0], range(len(prompts[0]))))
        masks = [TreeMask(len(p), torch.from_numpy(ancestors_of(t))) for p, t in zip(prompts, trees, strict=True)]
        positions = [len(p) + ancestors_of(t).sum(1) - 1 for p, t in zip(prompts, trees, strict=True)]
        logits.append(runner.forward_batch(caches, np.concatenate(tokens), np.concatenate(positions),
                                           [len(t) for t in trees], masks))
        logits.append(runner.forward(single, tokens[0], positions[0], masks[0]))
        results.append((logits, [[t.clone() for t in c.layer_kv(layer)] for c in caches for layer in (0, 1)]))
    assert launches == [63, 63, 37, 37, 26, 26, 9, 9]  # per layer: the batch, the single session (x2 steps)
    (want, want_kv), (got, got_kv) = results
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for i, (g, w) in enumerate(zip(got_kv, want_kv, strict=True)):
        exact = i % 2 == 0  # layer 0's keys/values come before any attention: written bit for bit
        torch.testing.assert_close(g, w, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-4)


def test_runner_metadata_is_16_byte_aligned(runners, monkeypatch):
    """Every metadata tensor the runner passes starts on a 16-byte boundary whatever the batch and tree sizes:
    Triton compiles one kernel variant per pointer alignment, so an unaligned split would compile new
    variants mid-serving."""
    from specmesh.model_runner import TreeMask

    _, kernel = runners
    seen, real = [], ta.tree_attention

    def record(q, k, v, cu_q, kv_len, tree_start, tables, block_size, mask=None, **kw):
        seen.append([t.data_ptr() % 16 for t in (cu_q, kv_len, tree_start, tables, mask) if t is not None])
        return real(q, k, v, cu_q, kv_len, tree_start, tables, block_size, mask, **kw)

    monkeypatch.setattr(ta, "tree_attention", record)
    rng = random.Random(5)
    pool = kernel.new_pool(num_blocks=64, block_size=4)
    for batch in (1, 2, 3, 5):
        prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 9))] for _ in range(batch)]
        trees = [tree_parents("random", rng.randint(1, 7), rng) for _ in range(batch)]
        caches = [pool.open(len(p) + len(t) + 1) for p, t in zip(prompts, trees, strict=True)]
        kernel.forward_batch(caches, np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]),
                             [len(p) for p in prompts], [None] * batch)
        masks = [TreeMask(len(p), torch.from_numpy(ancestors_of(t))) for p, t in zip(prompts, trees, strict=True)]
        positions = [len(p) + ancestors_of(t).sum(1) - 1 for p, t in zip(prompts, trees, strict=True)]
        kernel.forward_batch(caches, np.concatenate([rng.choices(range(128), k=len(t)) for t in trees]),
                             np.concatenate(positions), [len(t) for t in trees], masks)
        for cache in caches:
            cache.free()
    assert seen and all(offset == 0 for offsets in seen for offset in offsets), seen


def test_compile_variants_launches_every_tile_size():
    """compile_variants launches each BLOCK_M the launcher can pick for 1 .. max_rows rows, with and without
    a tree mask (under the interpreter here: it runs, it compiles nothing)."""
    for group, max_rows in ((2, 64), (3, 300), (1, 1024)):
        tiles = {ta.launch_config(group, n, 16)[0] for n in range(1, max_rows + 1)}
        if max_rows <= 64:  # per tile: unsplit and split, with and without a mask; the combine's other share counts
            assert ta.compile_variants(2 * group, 2, 16, torch.float32, torch.device(DEVICE), max_rows) == 4 * len(tiles) + 3
        rows_for = {}
        for n in (1 << i for i in range(max_rows.bit_length())):
            rows_for.setdefault(ta.launch_config(group, n, 16)[0], n)
        assert set(rows_for) == tiles


@pytest.mark.skipif(ta.INTERPRETED or not torch.cuda.is_available(), reason="compiles on a CUDA device only")
def test_no_kernel_compiles_after_compile_variants():
    """After compile_variants, launches of any batch, row count, table width and mask width compile nothing."""
    caches = getattr(ta._tree_attention_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches")
    ta.compile_variants(8, 2, 64, torch.bfloat16, torch.device("cuda"))
    before = sum(len(c[0]) for c in caches.values())
    rng = random.Random(6)
    for seed in range(12):
        shape = rng.choice([None, "random", "star", "chain", "deep_wide"])
        reqs = tuple(Request(rng.randint(1, 300), rng.randint(1, 16), shape, 16) if shape else
                     Request(rng.randint(0, 300), rng.randint(1, 600)) for _ in range(rng.randint(1, 6)))
        args = build(Config(reqs, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16), seed=seed)
        ta.tree_attention(**args)
    torch.cuda.synchronize()
    assert sum(len(c[0]) for c in caches.values()) == before


# ------------------------------------------------------------------------------ the verifier
def _tree_along(truth: list[int], rng: random.Random, max_nodes: int = 12) -> TokenTree:
    """A random tree whose first branch follows ``truth`` for a random length (so some of it is accepted)."""
    num_nodes = rng.randint(0, max_nodes)
    follow = rng.randint(0, min(num_nodes, len(truth)))
    parents = [i - 1 if i < follow else rng.randrange(-1, i) for i in range(num_nodes)]
    tokens = [truth[i] if i < follow else rng.randrange(128) for i in range(num_nodes)]
    return TokenTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.ones(num_nodes))


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(3, 2)], ids=["trees", "trees+window"])
def test_verifier_with_the_kernel_equals_autoregressive_greedy(runners, monkeypatch, lookahead):
    """Sessions batched in one LocalVerifier on the kernel path (chunked prefills beside tree verifies, a
    fragmented pool): every token committed is the autoregressive greedy token of the SDPA runner."""
    sdpa, kernel = runners
    launches = _count_launches(monkeypatch)
    rng = random.Random(4)
    max_new = 24
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (45, 7, 30, 1, 19)]
    truth = {f"s{i}": engine_for(sdpa).generate(p, greedy(max_new)).token_ids for i, p in enumerate(prompts)}
    verifier = LocalVerifier(kernel, max_tree_nodes=12, lookahead=lookahead, block_size=4, prefill_chunk=16,
                             kv_cache_gb=1000 * kernel.kv_bytes_per_token / 2**30)
    allocator = verifier.allocator
    blocks = [allocator.allocate(4) for _ in range(allocator.num_free)]  # one block each
    held = [table for table in blocks if table[0] % 2 == 0]
    for table in blocks:
        if table[0] % 2:
            allocator.free(table)  # every other block free again: session tables are stitched from single blocks
    committed = {}
    for i, prompt in enumerate(prompts):
        verifier.admit(f"s{i}", prompt, greedy(max_new))
    # admission takes the prompt's blocks: a one-block table is contiguous until it grows, stitched then too
    assert all(verifier._sessions[s].cache.base is None for s, p in zip(truth, prompts, strict=True) if len(p) > 4), \
        "the pool did not fragment"
    while any(committed.get(s, 0) < max_new - 13 for s in truth):
        prefilling = [s for s in truth if verifier.prefilling(s)]
        live = [s for s in truth if s in committed and committed[s] < max_new - 13]
        trees = [(s, _tree_along(truth[s][committed[s]:], rng)) for s in live]
        firsts, results = verifier.step(prefilling, trees)
        for sid, first in firsts.items():
            assert first == truth[sid][0], sid
            committed[sid] = 1
        for (sid, _), result in zip(trees, results, strict=True):
            assert not isinstance(result, Exception), result
            assert list(result.tokens) == truth[sid][committed[sid] : committed[sid] + len(result.tokens)], sid
            committed[sid] += len(result.tokens)
    assert sum(committed.values()) > len(truth) * (max_new - 13)
    assert launches and max(launches) > 16, "the kernel never ran a batched step"
    for sid in truth:
        verifier.release(sid)
    assert allocator.num_free == allocator.num_blocks - len(held)


def test_kernel_path_refuses_a_tree_out_of_order(runners):
    """A node that attends to a later node: SDPA would honour the dense mask, the kernel's causal term would
    drop it, so the kernel path refuses it instead of computing something else."""
    from specmesh.model_runner import TreeMask

    kernel = runners[1]
    cache = kernel.new_pool(num_blocks=8, block_size=4).open(16)
    kernel.forward(cache, [5, 6, 7], range(3))
    backwards = torch.tensor([[True, True], [False, True]])  # node 0 sees node 1
    with pytest.raises(ValueError, match="later node"):
        kernel.forward(cache, [8, 9], [3, 3], TreeMask(3, backwards))


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    """benchmarks/tree_attention.py --smoke: its tiny grid runs (checked against SDPA) and writes JSON + table."""
    import json

    from benchmarks import tree_attention as bench

    assert bench.main(["--smoke", "--cpu-repeats", "1", "--json", str(tmp_path / "smoke.json")]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert len(result["points"]) == 8 and result["copy_bandwidth_gbps"] > 0
    assert all(p["max_abs_err"] < 1e-4 and p["kernel_ms"] > 0 for p in result["points"])
    assert {p["prefix"]: p["kv_splits"] for p in result["points"]} == {40: 1, 1100: 2}  # split-KV ran and checked
    rows = [line for line in (tmp_path / "smoke.md").read_text().splitlines() if line[:3] in ("| 1", "| 3")]
    assert len(rows) == 8
