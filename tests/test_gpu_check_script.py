"""benchmarks/gpu_check.py is the one script a GPU session runs: keep it working without a GPU (--cpu-smoke runs
every section's plumbing on CPU with stand-ins) so device time is not spent on its bugs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--reps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for section in ("quantize", "scaled_mm", "grouped", "training", "comms"):
        assert report[section]["ok"] is True, (section, report[section])
    assert report["scaled_mm"]["rows"] and report["comms"]["checks"]["all_reduce"]
    assert [r["casts_bit_identical_to_cpu"] for r in report["training"]["rows"]] == [True, True]


def test_gpu_check_refuses_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script runs for real instead of refusing")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout
