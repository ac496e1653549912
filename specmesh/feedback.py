"""Feedback from verification to drafters: what the target saw beyond the accepted path.

A verifier may report, per verification (``VerifyFeedback``):

- the target's top-k next-token ids after every verified row (the pending token and each
  tree node): Token Recycling builds its adjacency table from these;
- n-grams harvested from a Jacobi window that rides along in the verifier's forward pass
  (lookahead decoding): the drafter adds them to its n-gram store.

The orchestrator collects the feedback of the verifications since its last drafter call and
hands it over with that call (``DraftFeedback``), together with how much of the drafter's
context is committed (the rest is a hypothesis drafted ahead on, PEARL), so that proposers
learn and calibrate from committed tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class VerifyFeedback:
    inputs: np.ndarray  # [rows] int64: input token of each verified row (pending token, then tree nodes)
    topk: np.ndarray  # [rows, k] int64: the target's top-k next-token ids after each row, best first
    ngrams: tuple[tuple[int, ...], ...] = ()  # n-grams harvested from the Jacobi window

    def __post_init__(self) -> None:
        if self.inputs.ndim != 1 or self.topk.ndim != 2 or self.topk.shape[0] != self.inputs.shape[0]:
            raise ValueError(f"feedback needs inputs [rows] and topk [rows, k]; got {self.inputs.shape}, {self.topk.shape}")

    @property
    def k(self) -> int:
        return int(self.topk.shape[1])

    @staticmethod
    def of(inputs: Sequence[int], topk: np.ndarray | None = None, ngrams: Sequence[Sequence[int]] = ()) -> VerifyFeedback:
        inputs = np.asarray(inputs, np.int64).reshape(-1)
        if topk is None:
            topk = np.zeros((inputs.shape[0], 0), np.int64)
        return VerifyFeedback(inputs, np.asarray(topk, np.int64), tuple(tuple(int(t) for t in g) for g in ngrams))


@dataclass(frozen=True, eq=False)
class TargetFeatures:
    """The target's final-layer features (what its LM head reads) of consecutive committed positions, for
    feature-based drafters (Falcon heads): the prefill's prompt rows, a verification's pending + accepted rows.
    Off unless a session asks for them (``Verifier.prefill(..., features=True)``; over gRPC
    ``PrefillRequest.return_features``, the rows travelling as bf16, ``specmesh.wire.features_to_proto``)."""

    start: int  # absolute position (0-based) of the first row
    rows: Any  # [n, hidden]: a torch tensor in process, float32 numpy decoded from the wire

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True)
class DraftFeedback:
    committed_len: int = 0  # tokens at the start of the context (after the call's edit) that are committed; 0 = not told
    verified: tuple[VerifyFeedback, ...] = field(default=())  # verifications since the drafter's last call
    features: tuple[TargetFeatures, ...] = field(default=())  # target features since the last call (Falcon)
