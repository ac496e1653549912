"""Sampling parameters of a request (torch-free: part of the contracts every floor speaks).

The warping they describe (temperature, then top-k, then top-p) is ``specmesh.warp.warp_probs``.
"""

from __future__ import annotations

from dataclasses import dataclass

# sane caps: every stop string is matched against the text of every step
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):  # NaN fails the comparison too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, each >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
