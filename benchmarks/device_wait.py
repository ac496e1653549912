"""`specmesh bench` on the CPU as if the forward ran on an asynchronous device: the host's share of a GPU step.

On a GPU the engine thread queues a step's forward and decisions, then waits for the step's one copy while the
device works; the interpreter lock is free meanwhile, and whatever else the process runs in Python (PEARL's
drafting thread, a gRPC server's threads) runs then. On the CPU the forward runs in the call, so that shape never
shows. This script gives it to any `specmesh bench` run: every in-process verifier is marked asynchronous
(``LocalVerifier.asynchronous``: the engine core's drafting ahead starts once the step is launched, as on CUDA)
and every step's copy (``HostCopy.wait``, in ``LocalVerifier.finish``) waits ``--wait-ms`` more with the lock
released. With the 1-layer, 128-wide
target of `benchmarks/engine_overhead.py` (whose forward costs about what launching a GPU forward does), what
is left is the host work of a GPU step around a device time you choose; the H200's demo-pair step was ~0.6 ms of
device time (`benchmarks/results/gpu_h200_2.md`).

Usage (arguments after ``--`` go to `specmesh bench`; without a ``--target`` among them, the 1-layer model,
built into ``~/.cache/specmesh-bench/tiny-llama-1x128`` on first use):

    python benchmarks/device_wait.py --wait-ms 1.0 -- --prompts ../shared/data/stdlib_functions.jsonl \\
        --limit 64 --max-new-tokens 128 --threads 1 --methods ar fused prompt_lookup_tree \\
        --concurrency 1 16 --json /tmp/device_wait.json

``--replay AR_JSON`` makes τ a real target's: the target's forward is replaced by a replay of its recorded greedy
outputs (a `specmesh bench --methods ar --json` report of the same ``--target``, prompts and tokenizer, as
`benchmarks/draft_cost.py` reads): at every row the largest logit is the recorded token after that row's
position, so every method accepts exactly what the target would (a row off the recorded path is never accepted,
so what it predicts does not matter). Greedy only, proposers without a draft model; the replayed forward's own cost
is a few numpy-free tensor writes:

    specmesh bench --prompts $P --target ../shared/models/stdlib-code/target --limit 16 --max-new-tokens 128 \\
        --threads 1 --methods ar --json /tmp/ar_pair.json
    python benchmarks/device_wait.py --wait-ms 0.6 --replay /tmp/ar_pair.json -- --prompts $P \\
        --target ../shared/models/stdlib-code/target --limit 16 --max-new-tokens 128 --threads 1 \\
        --methods ar fused prompt_lookup_tree --concurrency 1 16 --json /tmp/device_wait_replay.json

A timing benchmark, not a test: what it shows is where the host work of a step sits against a device wait, not
what any device would measure.
"""

from __future__ import annotations

import argparse
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages


def emulate(wait_s: float) -> None:
    """Mark every LocalVerifier made from here on asynchronous, and make every step's host copy wait ``wait_s``
    more without the interpreter lock (``time.sleep``)."""
    from verifier_service import decisions, verifier

    wait, init = decisions.HostCopy.wait, verifier.LocalVerifier.__init__

    def waiting_wait(self) -> None:  # the step's copy, started at its launch, lands ``wait_s`` later
        time.sleep(wait_s)
        wait(self)

    def asynchronous_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.asynchronous = True

    decisions.HostCopy.wait = waiting_wait
    verifier.LocalVerifier.__init__ = asynchronous_init


class ReplayRunner:
    """A target whose forward replays recorded greedy outputs (``recorded``: prompt ids -> output ids): the logits
    of a row at position p are a one-hot of the recorded token at p + 1 (see the module doc). Its sessions are the
    verifier's paged caches of a pool of one layer, one head and one dimension: each position's "key" is its token,
    so the verifier's compaction keeps the accepted path's tokens as it keeps a real target's keys."""

    def __init__(self, info, recorded: dict[tuple[int, ...], list[int]]) -> None:
        import torch

        self.info, self.recorded = info, recorded
        self.device, self.dtype = torch.device("cpu"), torch.float64  # token ids, exact in float64
        self.model = None  # no module (the bench's HF peers need a real target)
        self.paged_shape = (1, 1, 1)
        self.kv_bytes_per_token = 64  # a nominal size: the verifier's block budget counts rows, not memory
        self._outputs = weakref.WeakKeyDictionary()  # cache -> (prompt length, its recorded output), once known

    def new_pool(self, num_blocks: int, block_size: int):
        from specmesh.kv_pool import KVPool

        return KVPool(*self.paged_shape, num_blocks, block_size, self.dtype, self.device)

    def pool_graphs(self, pool) -> None:
        return None

    def _next(self, cache, position: int) -> int:
        known = self._outputs.get(cache)
        if known is None:  # the prompt is the session's first rows: found once its last row asks
            tokens = cache.kv(0, position + 1)[0].reshape(-1).long().tolist()
            output = self.recorded.get(tuple(tokens))
            if output is None:
                return 0
            known = self._outputs[cache] = (position + 1, output)
        prompt_len, output = known
        at = position + 1 - prompt_len
        return output[at] if 0 <= at < len(output) else (self.info.eos_token_ids or (0,))[0]

    def forward(self, cache, input_ids, position_ids, attend=None, last_only: bool = False, features: bool = False):
        """One session's rows: ``forward_batch`` of it alone (``last_only``: the last row's logits)."""
        import torch

        n = torch.as_tensor(input_ids).numel()
        return self.forward_batch([cache], input_ids, position_ids, [n], [attend], [n - 1] if last_only else None,
                                  torch.zeros(0) if features else None)

    def forward_batch(self, caches, input_ids, position_ids, num_new, attends, logit_rows=None, hidden_rows=None):
        import torch

        if hidden_rows is not None:
            raise NotImplementedError("a replayed target has no features (Falcon heads need a real one)")
        ids = torch.as_tensor(input_ids).reshape(-1).to(self.dtype)
        positions = torch.as_tensor(position_ids).reshape(-1).tolist()
        owner, row = [], 0
        for cache, n in zip(caches, num_new, strict=True):
            cache.ensure(cache.length + n)
            cache.write(0, cache.length, ids[None, row : row + n, None], ids[None, row : row + n, None])
            cache.length += n
            owner += [cache] * n
            row += n
        wanted = range(row) if logit_rows is None else torch.as_tensor(logit_rows).reshape(-1).tolist()
        logits = torch.zeros(len(wanted), self.info.vocab_size)
        for i, r in enumerate(wanted):
            logits[i, self._next(owner[r], positions[r])] = 1.0
        return logits


def recorded_outputs(report_path: Path, target: str, prompts_path: str | None) -> dict[tuple[int, ...], list[int]]:
    """prompt ids -> greedy output ids of the ``ar`` records of a `specmesh bench --json` report."""
    from benchmarks.draft_cost import recorded_ar

    try:
        prompts, outputs, _ = recorded_ar(report_path, target, prompts_path)
    except ValueError as exc:
        raise SystemExit(f"device_wait: {exc}") from exc
    return {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}


def replay(report_path: Path, bench: list[str]) -> None:
    """Replace the bench's target runner by a ``ReplayRunner`` of the report's outputs."""
    from orchestrator import embedded

    target = bench[bench.index("--target") + 1] if "--target" in bench else None
    if target is None:
        raise SystemExit("device_wait: --replay needs the bench's --target (the recorded target: its tokenizer)")
    prompts = bench[bench.index("--prompts") + 1] if "--prompts" in bench else None
    recorded = recorded_outputs(report_path, target, prompts)
    load = embedded.load_runner

    def load_replayed(path, *args, **kwargs):
        runner = load(path, *args, **kwargs)
        if str(path) != str(target):
            return runner  # a draft model stays itself
        return ReplayRunner(runner.info, recorded)

    embedded.load_runner = load_replayed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wait-ms", type=float, default=1.0,
                   help="device time per step: what every step's one copy waits, the interpreter lock free")
    p.add_argument("--replay", type=Path, default=None, metavar="AR_JSON",
                   help="replay the target's recorded greedy outputs instead of running it (see the module doc)")
    args = p.parse_args(ours)
    if args.wait_ms < 0:
        p.error("--wait-ms must be >= 0")
    if not bench:
        p.error("give `specmesh bench` arguments after --")
    if "--target" not in bench and not any(a.startswith("--target=") for a in bench):
        from benchmarks.engine_overhead import DEFAULT_MODEL_DIR, build_model

        bench += ["--target", str(build_model(DEFAULT_MODEL_DIR))]
    if args.replay is not None:
        replay(args.replay, bench)
    emulate(args.wait_ms / 1000)
    from specmesh_app.cli import main as specmesh_main

    return specmesh_main(["bench", *bench])


if __name__ == "__main__":
    sys.exit(main())
