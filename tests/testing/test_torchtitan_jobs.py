"""The torchtitan job launcher (``torchnext.testing.torchtitan_jobs``): a job past its timeout is stopped with every
worker it started (none left alive), and says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.titan, pytest.mark.timeout(300)]


@pytest.mark.slow
def test_a_job_past_its_timeout_is_killed_with_every_worker(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchnext[titan])")
    from torchnext.testing.torchtitan_jobs import TitanJob, run_jobs

    (tmp_path / "hang_forever.py").write_text("import time\nprint('worker up', flush=True)\ntime.sleep(3600)\n")
    job = TitanJob(name="hang", launcher="torchrun", runs=[[]], common=[], module="hang_forever",
                   env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"})
    (res,) = run_jobs([job], tmp_path, timeout_s=30)
    assert res.log.count("worker up") == 2, res.log[-3000:]
    assert res.returncode is None and res.leftover == []
    with pytest.raises(AssertionError, match="exit None"):
        res.check()
    with pytest.raises(ValueError, match="unknown launcher"):
        run_jobs([TitanJob(name="x", launcher="mpirun", runs=[], common=[])], tmp_path, timeout_s=1)
