"""benchmarks/ft/bench_parallel.py keeps working: ``--quick`` runs every section's plumbing (FT-DDP / FT-HSDP per-step
overhead against torch DDP / FSDP2 on plain groups, recovery from a kill, the torchft peer) on CPU. The figures of a
quick run are too noisy to check; what is checked is that every table is produced from real measurements and that
the torchft peer is skipped with a printed reason when its virtual environment is absent (CI has no torchft)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ft" / "bench_parallel.py"
TORCHFT_PYTHON = "/work/venvs/torchft/bin/python"


def _run(tmp_path: Path, *extra: str, timeout: float = 240) -> tuple[str, dict]:
    out = tmp_path / "bench_parallel.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out), *extra], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_quick_run_without_torchft(tmp_path: Path) -> None:
    stdout, report = _run(tmp_path, "--torchft-python", str(tmp_path / "no-venv" / "bin" / "python"), "--find-unused",
          "--defer-commit")
    assert "## per-step overhead" in stdout and "## recovery, FT-DDP" in stdout and "## recovery, FT-HSDP" in stdout
    rows = report["overhead"]
    assert {(r["parallelism"], r["compute_ms"]) for r in rows} == {(k, ms) for k in ("ddp", "hsdp") for ms in (0, 20)}
    assert {r["compute_ms"] for r in rows if r.get("variant") == "ft_find_unused"} == {0, 20}  # FT-DDP, the same run
    assert "FT-DDP (find_unused_parameters=True)" in stdout
    assert {r["compute_ms"] for r in rows if r.get("variant") == "ft_deferred"} == {0, 20}
    assert "FT-DDP (defer_commit)" in stdout
    for r in rows:
        assert r["baseline_ms"] > 0 and r["ft_ms"] > 0 and math.isfinite(r["overhead_pct"])
        assert r["phase_ft.commit_ms"] > 0
    for kind in ("ddp", "hsdp"):
        rec = report["recovery"][kind]
        assert rec["n"] >= 1 and 0 < rec["p50_ms"] < 30_000, rec
    assert isinstance(report["torchft"], str) and report["torchft"].startswith("skipped: no torchft python")
    assert "skipped: no torchft python" in stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHFT_PYTHON), reason=f"no torchft virtual environment at {TORCHFT_PYTHON}")
def test_quick_torchft_peer(tmp_path: Path) -> None:
    stdout, report = _run(tmp_path, "--only", "torchft", "--torchft-python", TORCHFT_PYTHON)
    peer = report["torchft"]
    assert isinstance(peer, dict), peer
    assert peer["torchft_version"] == "0.2.0"
    assert [r["compute_ms"] for r in peer["overhead"]] == [0, 20]
    assert all(r["plain_ms"] > 0 and r["torchft_ms"] > 0 for r in peer["overhead"])
    assert "## peer: torchft 0.2.0 DDP" in stdout
