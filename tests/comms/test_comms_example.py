"""The README's comms example runs end to end (it launches its own two ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "comms_allreduce.py"


def test_example_allreduce_runs() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("sum = [10.0, 12.0, 14.0, 16.0], max = [10.0, 12.0, 14.0, 16.0]") == 2
