"""A `specmesh drafter` whose draft_model proposer misbehaves, for the fault tests.

    python tests/fault_drafters.py {slow,garbage,crash} drafter [drafter options...]

The fault replaces the registered ``draft_model`` proposer inside the drafter process,
so the orchestrator talks to it through the real contract:
- slow: a correct draft chain, delivered 0.6 s late (misses any sane step deadline);
- garbage: trees with out-of-vocabulary token ids and a broken parent index;
- crash: the process exits abruptly on the 3rd proposal (like kill -9 mid-request).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

from drafter_service import draft_model
from drafter_service.proposer import Proposer, proposer_spec, register
from specmesh.tree import TokenTree
from specmesh_app.cli import main


def install(fault: str) -> None:
    calls = {"n": 0}

    def _faulty(**resources):
        inner = draft_model.chain_proposer(**resources)

        class Faulty(Proposer):
            name = "draft_model"

            def propose(self, state, budget):
                calls["n"] += 1
                if fault == "slow":
                    time.sleep(0.6)
                    return inner.propose(state, budget)
                if fault == "crash" and calls["n"] >= 3:
                    os._exit(3)
                if fault == "garbage":
                    return TokenTree(np.array([10**7, 5]), np.array([-1, 7]), np.array([0.5, 0.5]))
                return inner.propose(state, budget)

            def release(self, state):
                inner.release(state)

        return Faulty()

    register(dataclasses.replace(proposer_spec("draft_model"), factory=_faulty))


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
