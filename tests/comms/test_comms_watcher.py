"""The unwaited-op watcher (``torchnext.comms.work.UnwaitedWatcher``): async ops nobody waits on still complete
(post hooks, in-flight table) after the grace period; the watcher costs nothing per op and sleeps when idle."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from torchnext.comms import Communicator, WorkStatus
from torchnext.comms.work import _GRACE_S, _NAP_S

_SLACK_S = 5.0  # a loaded CI machine: generous, the bound being tested is "completes", not "how fast"


def _comm(name: str) -> Communicator:
    return Communicator(dist.HashStore(), 0, 1, name=name)


def _until(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return bool(cond())


def test_an_op_nobody_waits_on_completes_after_the_grace_period() -> None:
    comm = _comm("unwaited")
    done: list[Any] = []
    comm.register_post_hook(lambda args: done.append(args.status))
    try:
        t0 = time.monotonic()
        work = comm.all_reduce(torch.ones(4), async_op=True)
        assert work is not None
        # The backend finished at once (one rank), but nobody looked: the watcher must notice it.
        assert _until(lambda: done, _GRACE_S + _NAP_S + _SLACK_S), "post hook never ran for an unwaited op"
        assert time.monotonic() - t0 >= _GRACE_S * 0.9  # not before the grace: a waiter would have been faster
        assert done == [WorkStatus.COMPLETED]
        assert work.status is WorkStatus.COMPLETED and not comm._in_flight
    finally:
        comm.shutdown()


def test_the_watcher_sleeps_when_idle_and_wakes_for_a_new_op() -> None:
    comm = _comm("idle")
    done = threading.Event()
    comm.register_post_hook(lambda args: done.set())
    try:
        comm.all_reduce(torch.ones(1), async_op=True).wait()  # type: ignore[union-attr]
        watcher = comm._unwaited
        assert watcher is not None
        assert _until(lambda: watcher.idle, 20 * _NAP_S + _SLACK_S), "watcher never went idle with nothing in flight"
        done.clear()
        comm.all_reduce(torch.ones(1), async_op=True)  # never waited on: only the woken watcher can finish it
        assert not watcher.idle
        assert done.wait(_GRACE_S + _NAP_S + _SLACK_S), "an op issued while the watcher slept was never finished"
    finally:
        comm.shutdown()


def test_a_stream_of_waited_ops_wakes_the_watcher_at_most_once_per_nap() -> None:
    comm = _comm("stream")
    try:
        comm.all_reduce(torch.ones(1), async_op=True).wait()  # type: ignore[union-attr]
        watcher = comm._unwaited
        assert watcher is not None
        wakes = 0
        real_wake = watcher.wake

        def counting_wake() -> None:
            nonlocal wakes
            wakes += 1
            real_wake()

        watcher.wake = counting_wake  # type: ignore[method-assign]
        t = torch.ones(1)
        t0 = time.monotonic()
        for _ in range(2000):
            comm.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]
        elapsed = time.monotonic() - t0
        # One wake-up per nap at most (the watcher only goes idle at a look, once per nap), never one per op.
        assert wakes <= elapsed / _NAP_S + 2, (wakes, elapsed)
        assert wakes < 2000
    finally:
        comm.shutdown()


def test_shutdown_stops_a_sleeping_and_a_looking_watcher() -> None:
    for wait_first in (True, False):
        comm = _comm(f"close{int(wait_first)}")
        work = comm.all_reduce(torch.ones(1), async_op=True)
        assert work is not None
        if wait_first:
            work.wait()
        watcher = comm._unwaited
        assert watcher is not None
        comm.shutdown()  # waits for the op in flight, then closes the watcher
        watcher._thread.join(timeout=_SLACK_S)
        assert not watcher._thread.is_alive()
