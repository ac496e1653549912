"""The verifier's user-facing options, shared by `specmesh verifier` and the embedded commands."""

from __future__ import annotations

import argparse

from specmesh.blocks import DEFAULT_BLOCK_SIZE

# the verifier's batching defaults (here, without torch, so that `--help` stays fast)
DEFAULT_KV_CACHE_GB = 2.0  # the KV pool's budget off CUDA when none is given (capped: see verifier.kv_pool_blocks)
DEFAULT_KV_CACHE_MEMORY = 0.9  # on CUDA: the share of the device's memory the process may use with its KV pool
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per step of one session's prefill
DEFAULT_MAX_BATCH_TOKENS = 2048  # rows per batched forward
DEFAULT_MAX_WAITING = 256  # Prefills waiting for KV blocks


def add_lookahead_argument(p: argparse.ArgumentParser, help: str) -> None:
    from verifier_service.lookahead import LookaheadConfig

    p.add_argument("--lookahead", type=LookaheadConfig.argument, default=None, metavar="W,N", help=help)


def add_batching_arguments(p: argparse.ArgumentParser) -> None:
    """The KV pool and the continuous-batching scheduler (`specmesh verifier`, and embedded `bench`)."""
    g = p.add_argument_group("KV pool and batching")
    g.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help=f"memory of the paged KV pool shared by all sessions, taken block by block as they are "
                        f"written (admission: the prompt's; a step: its rows'); when a step cannot get its blocks, "
                        f"the newest session is preempted and recomputed later; the context served is at most what "
                        f"one session alone can hold (default: on CUDA, sized by --kv-cache-memory; elsewhere "
                        f"{DEFAULT_KV_CACHE_GB:g}, or less when 64 sessions at full context need less)")
    g.add_argument("--kv-cache-memory", type=float, default=DEFAULT_KV_CACHE_MEMORY, metavar="FRACTION",
                   help=f"on CUDA without --kv-cache-gb: the share of the device's memory this process may use, the "
                        f"KV pool taking what the weights, other processes and a profiled forward of "
                        f"--max-batch-tokens rows leave of it (default: {DEFAULT_KV_CACHE_MEMORY:g})")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of identical prompt prefixes between sessions (by default full "
                        "blocks of committed tokens are cached, read-only, and evicted least recently used)")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
                   help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE})")
    g.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="N",
                   help=f"rows per batched forward: every pending Verify, then prompt chunks up to this "
                        f"(default: {DEFAULT_MAX_BATCH_TOKENS})")
    g.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens of one session per step, so a long prompt never stalls decoding "
                        f"(default: {DEFAULT_PREFILL_CHUNK})")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help=f"Prefills waiting for KV blocks; more get RESOURCE_EXHAUSTED (default: "
                        f"{DEFAULT_MAX_WAITING})")
