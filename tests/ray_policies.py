"""Test-only Ray Serve autoscaling policy: the replica count a test writes to a file, so that a test scales a
pool at the moment it chooses, through Serve's own autoscaling path (a config-free, in-place change)."""

from __future__ import annotations

from pathlib import Path


class CountFromFile:
    """``policy_kwargs: {path: ...}``; the file holds the wanted replica count (Serve clamps it to min/max)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def __call__(self, ctx) -> tuple[int, dict]:
        try:
            return int(self.path.read_text()), {}
        except (OSError, ValueError):
            return ctx.current_num_replicas, {}
