"""The window examples run end to end (each launches its own 4 ranks) and match their references."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sharded_embedding_lookup_equals_dense(transport: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "window_embedding.py"), "--transport", transport],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("equals dense table[ids]: True") == 4
    assert f"transport to rank 0: {transport}" in proc.stdout


def test_moe_dispatch_equals_reference() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "window_moe.py")], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MoE dispatch equals the single-process reference" in proc.stdout
