"""``DistributedDataParallel(vote_early=True)``: the step's vote leaves when backward's last fault-tolerant op
completes, not when the training thread reaches ``step.commit()``; the contract around it.

Real members (threads, Gloo over loopback) and an in-process coordinator; every wait is bounded. The chaos test
with early votes is ``tests/ft/test_ft_parallel_chaos.py::test_ddp_chaos_10_schedules[vote-early]``."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from torchnext.comms import CommAborted
from torchnext.ft import (
    Coordinator,
    DistributedDataParallel,
)
from torchnext.testing import run_each
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)



torch.manual_seed(0)
_INIT = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


_FORWARD = threading.Lock()
"""Members are threads of one process here: their DDP forwards run one at a time (torch's DDP records the active
module in a class attribute, saved and restored around each forward -- two overlapping forwards leave one marked,
and every later torch.compile in the process would take it for a DDP region; see tests/conftest.py)."""


def _model() -> torch.nn.Module:
    """The same initial weights in every thread (the threads share torch's generator: no seeding in them)."""
    return copy.deepcopy(_INIT)


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def _train(i: int, coord: Coordinator, steps: int, *, vote_early: bool, defer: bool = False) -> dict[str, Any]:
    """Member ``i`` trains ``steps`` steps of FT-DDP; with ``vote_early`` (and no ``defer``) it waits, before each
    ``commit()``, for the early vote to have left (``before_commit``: whether it did within 10 s); ``defer``:
    ``FaultTolerantConfig(defer_commit=True)``, with the model and optimizer as its state."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {} if not defer else {
        "state_dict": lambda: {"m": model.state_dict(), "o": opt.state_dict()},
        "load_state_dict": lambda s: (model.load_state_dict(s["m"]), opt.load_state_dict(s["o"]))}
    with thread_member(coord, i, min_size=2, defer_commit=defer, **state) as ft:
        net = DistributedDataParallel(model, ft, vote_early=vote_early, bucket_cap_mb=64 * 4 / (1 << 20))
        before_commit = []
        while ft.step_count < steps or not ft.confirm():
            with ft.step() as step:
                x = torch.full((4, 8), float(i + 1 + ft.step_count))
                with _FORWARD:
                    loss = net(x).square().sum()
                loss.backward()
                # the completion of the last op voted already: wait for it *before* calling commit()
                want = ft.step_count + 1
                if vote_early and not defer:
                    before_commit.append(_wait_for(lambda w=want: ft.early_votes >= w, 10.0))
                if step.commit():
                    opt.step()
                opt.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        out = {"early": ft.early_votes, "before_commit": before_commit, "params": params}
        ft.finish()
        return out


def test_the_vote_is_sent_before_commit_and_training_matches_the_vote_at_commit() -> None:
    steps = 3
    results = {}
    for vote_early in (True, False):
        with thread_coordinator(2, min_size=2) as coord:
            results[vote_early] = run_each([lambda i=i, v=vote_early, c=coord: _train(i, c, steps, vote_early=v)
                                            for i in range(2)])
    early, late = results[True], results[False]
    for i in range(2):
        assert not isinstance(early[i], BaseException), early[i]
        assert not isinstance(late[i], BaseException), late[i]
        assert early[i]["early"] == steps and all(early[i]["before_commit"]), early[i]
        assert late[i]["early"] == 0, late[i]
        for a, b in zip(early[i]["params"], late[i]["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(early[0]["params"], early[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_a_fault_tolerant_collective_after_the_early_vote_raises() -> None:
    def train(i: int, coord: Coordinator) -> Any:
        with thread_member(coord, i, min_size=2) as ft:
            model = _model()
            net = DistributedDataParallel(model, ft, vote_early=True)
            with ft.step() as step:
                with _FORWARD:
                    loss = net(torch.ones(2, 8)).sum()
                loss.backward()
                assert _wait_for(lambda: ft.early_votes == 1)
                with pytest.raises(RuntimeError, match="after this step's vote was sent"):
                    ft.process_group.allreduce([torch.ones(2)])
                committed = step.commit()
            ft.process_group.allreduce([torch.ones(2)]).wait()  # after the step: allowed again
            ft.finish()
            return committed

    with thread_coordinator(2, min_size=2) as coord:
        out = run_each([lambda i=i: train(i, coord) for i in range(2)])
    assert out == {0: True, 1: True}, out


def test_a_transient_error_after_a_committed_early_vote_leaves_the_group() -> None:
    """Member 1 raises a transient error between its (early) vote and commit(): the others committed the step it
    voted for, so it holds no committed state -- it leaves (a restart would rejoin and heal), member 0 goes on."""

    def train(i: int, coord: Coordinator) -> Any:
        ft = thread_member(coord, i, min_size=1)
        try:
            model = _model()
            net = DistributedDataParallel(model, ft, vote_early=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            while ft.step_count < 3:
                with ft.step() as step:
                    with _FORWARD:
                        loss = net(torch.ones(2, 8)).sum()
                    loss.backward()
                    if i == 1 and ft.step_count == 1:
                        assert _wait_for(lambda: ft.early_votes == 2)
                        raise CommAborted("injected after the early vote")
                    if step.commit():
                        opt.step()
                    opt.zero_grad()
            ft.finish()
            return ("done", ft.step_count, ft.size)
        except CommAborted as exc:
            return ("left", ft.step_count, "".join(getattr(exc, "__notes__", [])))
        finally:
            ft.close()

    with thread_coordinator(2, min_size=1) as coord:
        out = run_each([lambda i=i: train(i, coord) for i in range(2)])
    assert out[0] == ("done", 3, 1), out
    kind, count, note = out[1]
    assert (kind, count) == ("left", 2) and "left the group" in note, out


def test_under_defer_commit_the_vote_is_not_sent_early() -> None:
    """``FaultTolerantConfig(defer_commit=True)``: the vote for a step must follow the previous step's decision, which
    the training thread awaits at ``step.commit()`` -- the early vote stands aside, and training is unchanged."""
    steps = 3
    results = {}
    for defer in (True, False):
        with thread_coordinator(2, min_size=2) as coord:
            results[defer] = run_each([lambda i=i, c=coord, d=defer: _train(i, c, steps, vote_early=True, defer=d)
                                       for i in range(2)])
    for i in range(2):
        deferred, at_commit = results[True][i], results[False][i]
        assert not isinstance(deferred, BaseException) and not isinstance(at_commit, BaseException), (deferred,
                                                                                                      at_commit)
        assert deferred["early"] == 0 and at_commit["early"] == steps, (deferred["early"], at_commit["early"])
        for a, b in zip(deferred["params"], at_commit["params"], strict=True):
            assert torch.equal(a, b)
