"""`torchnext demo` end to end: 4 local ranks, a rank SIGKILLed mid-training, a warm spare heals and joins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "torchnext", "demo", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.timeout(300)
def test_demo_kill_and_rejoin(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _run(["--ranks", "4", "--steps", "40", "--kill-rank", "2", "--kill-step", "10", "--rejoin", "--quiet",
                 "--out", str(out)], timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("steps_completed", "initial_loss", "final_loss", "world_size_history", "failures",
                "params_equal_across_ranks", "precision", "wall_s"):
        assert key in summary, key
    assert summary["error"] is None
    assert summary["steps_completed"] == 40
    assert summary["final_loss"] < summary["initial_loss"] - 0.8
    assert summary["params_equal_across_ranks"] is True
    assert sorted(summary["final_members"]) == [0, 1, 3, 4]  # rank 2 gone, the spare (member 4) healed and joined
    (failure,) = summary["failures"]
    assert failure["kind"] == "kill" and failure["rank"] == 2 and failure["step"] == 10
    for k in ("detect_s", "agree_s", "rebuild_s"):
        assert isinstance(failure[k], float) and 0 <= failure[k] < 30, failure
    assert summary["world_size_history"][0]["size"] == 4
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "fr_timeline.png").exists()
    assert sorted(p.name for p in (out / "fr").glob("*.json"))  # survivors' Flight Recorder dumps
    report = (out / "fr_report.txt").read_text()
    assert "2" in report and ("missing" in report or "without a dump" in report), report
    # the report tells the failure: the generation that ended, what was in flight, who vanished and how, and the
    # generation that formed next (the kill lands between collectives or inside one: both are told)
    assert re.search(r"generation \d+ \('[^']+', members \[0, 1, 2, 3\]\) ended in a failure", report), report
    assert "in flight:" in report or "no op in flight (the ranks were between collectives" in report, report
    assert "rank 2 vanished (rank 2 left no dump)" in report, report
    # how: the coordinator saw its connection close -- or, first, a survivor's collective failed and was reported
    assert re.search(r"how: .*(connection closed|reported a failed collective|missed heartbeats)", report), report
    assert re.search(r"generation \d+ \('[^']+', members \[0, 1, 3(, 4)?\]\) formed [\d.]+ s later", report), report
    assert "rank 4 joined" in report, report  # the spare's generation: a reconfiguration, not a failure
    assert "dumped on abort" not in report, report  # the normal end is not worded as a crash
