"""torchnext.testing.coordinators: a coordinator forked from the forkserver (``fork=True``) behaves as the
``torchnext coordinator`` process it stands for -- it serves a member, prints its address and its stacks on
SIGUSR2, exits 0 on SIGTERM and -9 on SIGKILL, enters the network namespace it is given -- and is always reaped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.ft_workload import FTJob, WorkerSpec
from torchnext.testing.netns import NetLab, available

pytestmark = pytest.mark.timeout(120)

TOKEN = "forked-coordinator-token"


def test_a_forked_coordinator_serves_a_member_and_ends_as_a_process_would() -> None:
    with CoordinatorProcess(TOKEN, initial_size=1, fork=True) as coord:
        assert coord.alive() and coord.pid != os.getpid()
        assert coord.address.startswith("127.0.0.1:") and "in office" in coord.output()
        with FTJob() as job:
            job.launch(WorkerSpec(coordinator=coord.address, token=TOKEN, member_id=0, steps=3))
            reports = job.wait([0], timeout=60)
        assert reports[0]["error"] is None and reports[0]["step"] == 3, reports
        os.kill(coord.pid, signal.SIGUSR2)  # every thread's stack, into the output
        deadline = time.monotonic() + 10
        while "Thread 0x" not in coord.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Thread 0x" in coord.output()
        assert coord.terminate() == 0 and not coord.alive()


def test_a_forked_coordinator_killed_reports_sigkill_and_bad_arguments_are_refused() -> None:
    coord = CoordinatorProcess(TOKEN, standby=True, fork=True).start()
    try:
        coord.kill()
        assert coord.returncode == -signal.SIGKILL
    finally:
        coord.close()
    bad = CoordinatorProcess(TOKEN, fork=True, extra=["--min-size", "0"])
    with pytest.raises(RuntimeError, match="did not start"):
        bad.start()
    assert bad.returncode not in (None, 0)
    with pytest.raises(ValueError, match="netns= is for fork=True"):
        CoordinatorProcess(TOKEN, netns="x")
    with pytest.raises(ValueError, match="no prefix"):
        CoordinatorProcess(TOKEN, fork=True, prefix=["ip", "netns", "exec", "x"])


@pytest.mark.skipif(not available()[0], reason=f"network namespaces unavailable: {available()[1]}")
def test_a_forked_coordinator_listens_inside_its_network_namespace() -> None:
    with NetLab(2) as lab, CoordinatorProcess(TOKEN, host=lab.address(0), standby=True, fork=True,
                                              netns=lab.netns(0)) as coord:
        assert coord.address.startswith(f"{lab.address(0)}:"), coord.output()
        assert os.readlink(f"/proc/{coord.pid}/ns/net") != os.readlink("/proc/self/ns/net")
