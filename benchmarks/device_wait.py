"""`specmesh bench` on the CPU as if the forward ran on an asynchronous device: the host's share of a GPU step.

On a GPU the engine thread queues a step's forward and decisions, then waits for the step's one copy while the
device works; the interpreter lock is free meanwhile, and whatever else the process runs in Python (PEARL's
drafting thread, a gRPC server's threads) runs then. On the CPU the forward runs in the call, so that shape never
shows. This script gives it to any `specmesh bench` run: every in-process verifier is marked asynchronous
(``LocalVerifier.asynchronous``: its ``waiting`` call comes after the forward, in the copy, as on CUDA) and
every step's copy (``HostCopy.fetch``) waits ``--wait-ms`` more with the lock released. With the 1-layer, 128-wide
target of `benchmarks/engine_overhead.py` (whose forward costs about what launching a GPU forward does), what
is left is the host work of a GPU step around a device time you choose; the H200's demo-pair step was ~0.6 ms of
device time (`benchmarks/results/gpu_h200_2.md`).

Usage (arguments after ``--`` go to `specmesh bench`; without a ``--target`` among them, the 1-layer model,
built into ``~/.cache/specmesh-bench/tiny-llama-1x128`` on first use):

    python benchmarks/device_wait.py --wait-ms 1.0 -- --prompts ../shared/data/stdlib_functions.jsonl \\
        --limit 64 --max-new-tokens 128 --threads 1 --methods ar fused prompt_lookup_tree \\
        --concurrency 1 16 --json /tmp/device_wait.json

A timing benchmark, not a test: what it shows is where the host work of a step sits against a device wait, not
what any device would measure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages


def emulate(wait_s: float) -> None:
    """Mark every LocalVerifier made from here on asynchronous, and make every step's host copy wait ``wait_s``
    more without the interpreter lock (``time.sleep``)."""
    from verifier_service import decisions, verifier

    fetch, init = decisions.HostCopy.fetch, verifier.LocalVerifier.__init__

    def waiting_fetch(self, waiting=None) -> None:
        fetch(self, waiting)  # (calls ``waiting`` once it has its tensors, before its copy)
        time.sleep(wait_s)

    def asynchronous_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.asynchronous = True

    decisions.HostCopy.fetch = waiting_fetch
    verifier.LocalVerifier.__init__ = asynchronous_init


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wait-ms", type=float, default=1.0,
                   help="device time per step: what every step's one copy waits, the interpreter lock free")
    args = p.parse_args(ours)
    if args.wait_ms < 0:
        p.error("--wait-ms must be >= 0")
    if not bench:
        p.error("give `specmesh bench` arguments after --")
    if "--target" not in bench and not any(a.startswith("--target=") for a in bench):
        from benchmarks.engine_overhead import DEFAULT_MODEL_DIR, build_model

        bench += ["--target", str(build_model(DEFAULT_MODEL_DIR))]
    emulate(args.wait_ms / 1000)
    from specmesh.app.cli import main as specmesh_main

    return specmesh_main(["bench", *bench])


if __name__ == "__main__":
    sys.exit(main())
