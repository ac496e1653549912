"""What a verifier's forward costs, as the load-aware speculation policy reads it: a start-up profile refitted
from the verifier's own steps.

``LocalVerifier.profile_costs`` times a few forwards at start-up (1 and 8 scratch sessions of 128 positions, 1 and 8
rows each) and fits seconds = base + per_session * sessions + per_row * rows (``fit_verify_costs``). Serving steps
differ from those: contexts grow to hundreds or thousands of positions (each session's attention reads them all),
and a CPU's products change kernels with the row count (oneDNN's packed bf16 below 48 rows, float32 above), so the
profile's line can be off by 10-40 % where the batch runs (SmolLM2-135M bf16, 16 sessions of 300 positions: 100 ms
predicted for 16 rows against 109 measured, 124 against 147-163 for 24 rows). The policy weighs a tree's rows
against the whole step's time, so a wrong line sizes every tree wrong.

``StepCosts`` keeps the profile and refits it every ``refit_every`` steps to the last ``window`` steps that ran
no prompt chunk (a chunk's rows cost what the line does not model): two factors, one on the profile's fixed and
per-session part and one on its per-row part (``refit_costs``), shrunk lightly towards 1 (``prior_weight``). Where
the verifier has run, its steps decide the step's time and, where their rows vary, a row's cost; the profile's
shape carries that to batch sizes not seen. A replica reports its current fit in every VerifyBatch answer, and its
callers hold it as ``ReportedCosts``. Both are ``LiveCosts``: policies keep the object, and a refit swaps its one
immutable ``VerifyCosts`` (steps are observed on the loop's thread; the engine core's drafting thread reads too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from specmesh.contract import VerifyCosts

MAX_FACTOR = 8.0  # the refit scales the profile's parts by at most this either way (``refit_costs``)


def fit_verify_costs(points: Sequence[tuple[int, int, float]]) -> VerifyCosts:
    """Least squares of seconds = base + per_session * sessions + per_row * rows over (sessions, rows, seconds)
    points, every coefficient >= 0: the best fit over the subsets of coefficients left free (the rest 0) whose
    free ones come out >= 0 (exact non-negative least squares for three unknowns)."""
    data = np.asarray(points, np.float64)
    design = np.stack([np.ones(len(data)), data[:, 0], data[:, 1]], axis=1)
    target = data[:, 2]
    best, best_error = np.zeros(3), float(target @ target)
    for free in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]):
        coef, *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
        if (coef < 0).any():
            continue
        residual = design[:, free] @ coef - target
        if (error := float(residual @ residual)) < best_error * (1 - 1e-12):
            best, best_error = np.zeros(3), error
            best[free] = coef
    return VerifyCosts(float(best[0]), float(best[1]), float(best[2]))


def refit_costs(profile: VerifyCosts, steps: Sequence[tuple[int, int, float]], prior_weight: float,
                max_factor: float = MAX_FACTOR) -> VerifyCosts:
    """The profile with its fixed and per-session part scaled by a and its per-row part by b: the least squares
    of seconds = a (base + per_session * sessions) + b per_row * rows over ``steps`` (sessions, rows, seconds),
    with a and b shrunk towards 1 (each as if ``prior_weight`` steps of the profile's mean predicted time had
    said so) and kept within [1 / max_factor, max_factor]. Steps of one size fix the total there and, through
    the prior, move both factors the same way (each in proportion to its part's share of the step); steps whose
    rows vary at a batch size fix the slope too. The profile's shape carries the correction to batch sizes not
    seen."""
    if not steps:
        return profile
    data = np.asarray(steps, np.float64)
    fixed = profile.base + profile.per_session * data[:, 0]
    per_row = profile.per_row * data[:, 1]
    prior = np.sqrt(prior_weight) * float(np.mean(fixed + per_row))
    design = np.concatenate([np.stack([fixed, per_row], axis=1), prior * np.eye(2)])
    target = np.concatenate([data[:, 2], [prior, prior]])
    a, b = np.linalg.lstsq(design, target, rcond=None)[0]
    low = 1 / max_factor
    if not low <= b <= max_factor:  # the slope out of bounds: held at the bound, the rest refitted
        b = min(max(b, low), max_factor)
        a = float(np.linalg.lstsq(design[:, :1], target - b * design[:, 1], rcond=None)[0][0])
    a = min(max(float(a), low), max_factor)
    return VerifyCosts(a * profile.base, a * profile.per_session, float(b) * profile.per_row)


class LiveCosts:
    """Forward costs that change while they are held (a policy keeps the object, not a copy): reads like a
    ``VerifyCosts`` (``seconds``, ``base``, ``per_session``, ``per_row``: ``current``'s), and a change swaps
    ``current`` for another immutable ``VerifyCosts``, so a reader on another thread sees one fit or the other."""

    def __init__(self, costs: VerifyCosts) -> None:
        self.current = costs

    def seconds(self, sessions: int, rows: int) -> float:
        return self.current.seconds(sessions, rows)

    @property
    def base(self) -> float:
        return self.current.base

    @property
    def per_session(self) -> float:
        return self.current.per_session

    @property
    def per_row(self) -> float:
        return self.current.per_row

    def __repr__(self) -> str:
        return f"{type(self).__name__}(current={self.current})"


class StepCosts(LiveCosts):
    """A verifier's forward costs: the start-up ``profile`` refitted to its recent steps (module doc)."""

    def __init__(self, profile: VerifyCosts, window: int = 256, refit_every: int = 16,
                 prior_weight: float = 0.01) -> None:
        super().__init__(profile)
        self.profile = profile
        self.refit_every, self.prior_weight = refit_every, prior_weight
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._since = 0
        self.observed = 0  # steps observed in all

    def observe(self, sessions: int, rows: int, seconds: float) -> None:
        """A step that verified ``rows`` rows of ``sessions`` sessions (no prompt chunk) in ``seconds``."""
        if sessions < 1 or rows < sessions or not seconds > 0:
            return
        self._steps.append((sessions, rows, seconds))
        self.observed += 1
        self._since += 1
        if self._since >= self.refit_every:
            self._since = 0
            self.current = refit_costs(self.profile, self._steps, self.prior_weight)

    def __repr__(self) -> str:
        return f"StepCosts(current={self.current}, profile={self.profile}, observed={self.observed})"


class ReportedCosts(LiveCosts):
    """A replica's forward costs as its callers hold them: what its ``Info`` said, then what each of its VerifyBatch
    answers says (its ``StepCosts``' current fit: ``update``)."""

    def update(self, costs: VerifyCosts) -> None:
        self.current = costs
