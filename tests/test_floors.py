"""The floors hold: application -> orchestrator -> drafter_service | verifier_service -> core.

`lint-imports` checks the contracts in pyproject.toml over every import statement (module level
and inside functions); the subprocess checks show what a process that only routes requests
really loads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: install the dev extra (pip install -e '.[dev]')")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("module", ["orchestrator.server", "specmesh.client", "specmesh.contract", "specmesh.wire",
                                    "drafter_service.remote", "verifier_service.remote", "specmesh.blocks",
                                    "verifier_service.arguments"])
def test_routing_modules_load_no_model_stack(module):
    """A gRPC orchestrator, the client SDK and the contracts never run a model: importing them loads no torch."""
    code = f"import sys, {module}; loaded = [m for m in ('torch', 'transformers') if m in sys.modules]; print(loaded)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"
