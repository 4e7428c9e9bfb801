"""torchnext.testing.procfs: /proc reads of a child (CPU seconds, stopped or not, gone) and forking without the
parent's garbage."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

from torchnext.testing.procfs import cpu_seconds, fork_without_garbage, is_stopped, stat_fields


def test_a_child_is_seen_busy_stopped_and_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while (cpu_seconds(child.pid) or 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (cpu_seconds(child.pid) or 0.0) >= 0.25  # its busy loop, counted
        assert not is_stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        while not is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait(30)
    assert stat_fields(child.pid) is None and cpu_seconds(child.pid) is None and not is_stopped(child.pid)


def test_fork_without_garbage_collects_freezes_and_leaves_an_earlier_freeze_alone() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    gc.unfreeze()  # (harmless: a frozen object only goes back to the oldest generation)
    Cycle()  # garbage: a cycle only a collection frees
    with fork_without_garbage():
        assert gc.get_freeze_count() > 0 and not any(type(o) is Cycle for o in gc.get_objects())
    assert gc.get_freeze_count() == 0
    gc.freeze()  # someone else froze first: theirs (and ours) stay frozen
    try:
        with fork_without_garbage():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
