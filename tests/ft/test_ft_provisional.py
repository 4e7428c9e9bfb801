"""``FaultTolerantConfig(defer_commit=True)``: a step's optimizer update applied before its commit decision,
revoked when the decision refuses it (:mod:`torchnext.ft.provisional`).

Real members (threads, Gloo over loopback) and an in-process coordinator; every wait is bounded. Each member's
gradient is a function of (step, member id), averaged over the live members with ``ft.all_reduce``; each member
logs the updates it holds (``_Trainer.applied``, part of its state: a revoked update leaves the log with it), so a
run is checked exactly: every step applied once, in order, over the members that committed it. The chaos test with
deferral is ``tests/ft/test_ft_parallel_chaos.py::test_ddp_chaos_10_schedules[deferred]``."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from torchnext.comms import CommAborted, ReduceOp
from torchnext.ft import Coordinator, FaultTolerant, FaultTolerantConfig, StepRevoked
from torchnext.ft.provisional import StateSnapshots
from torchnext.testing import run_each
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)

DIM = 16


def _grad(step: int, member: int) -> torch.Tensor:
    return torch.arange(DIM, dtype=torch.float64) * 0.01 + step * 0.1 + member


class _Trainer:
    """One member's model ``w``, a momentum buffer ``m`` standing in for optimizer state, and ``applied``: the
    ``(step, members)`` of every update ``w`` holds."""

    def __init__(self) -> None:
        self.w = torch.zeros(DIM, dtype=torch.float64)
        self.m = torch.zeros(DIM, dtype=torch.float64)
        self.applied: list[tuple[int, tuple[int, ...]]] = []

    def state(self) -> dict[str, Any]:
        return {"w": self.w, "opt": {"m": self.m, "applied": list(self.applied)}}

    def load(self, s: dict[str, Any]) -> None:
        self.w.copy_(s["w"])
        self.m.copy_(s["opt"]["m"])
        self.applied = [(int(a), tuple(b)) for a, b in s["opt"]["applied"]]

    def apply(self, step: int, members: tuple[int, ...], g: torch.Tensor) -> None:
        self.m.mul_(0.9).add_(g)
        self.w.sub_(0.5 * self.m)
        self.applied.append((step, members))


class _Leave(BaseException):
    """Ends a member's thread inside a step without a vote (a departure, not a step failure)."""


def _member(coord: Coordinator, i: int, trainer: _Trainer, *, defer: bool = True, min_size: int = 1) -> FaultTolerant:
    return thread_member(coord, i, min_size=min_size, defer_commit=defer, state_dict=trainer.state,
                         load_state_dict=trainer.load)


def _train(ft: FaultTolerant, trainer: _Trainer, steps: int, *,
           inside: Callable[[FaultTolerant, int], None] | None = None,
           after_commit: Callable[[FaultTolerant, int], None] | None = None) -> None:
    """Train until ``steps`` are committed (``confirm()``: the last one too); ``inside``/``after_commit`` run in each
    attempt after its all_reduce / after ``step.commit()`` returned True."""
    while ft.step_count < steps or not ft.confirm():
        with ft.step() as step:
            s = ft.step_count
            members = tuple(ft.members)
            g = _grad(s, ft.member_id)
            ft.all_reduce(g, ReduceOp.AVG)
            if inside is not None:
                inside(ft, s)
            if step.commit():
                trainer.apply(s, members, g)
                if after_commit is not None:
                    after_commit(ft, s)


def _replay(applied: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
    """``w`` after the logged updates (float64 on one process: equal to the members' up to rounding)."""
    t = _Trainer()
    for s, members in applied:
        t.apply(s, members, torch.stack([_grad(s, m) for m in members]).mean(0))
    return t.w


def test_deferred_training_equals_training_with_the_decision_awaited() -> None:
    steps = 6

    def run(i: int, coord: Coordinator, defer: bool) -> dict[str, Any]:
        trainer = _Trainer()
        with _member(coord, i, trainer, defer=defer, min_size=2) as ft:
            _train(ft, trainer, steps)
            out = {"w": trainer.w.clone(), "applied": list(trainer.applied), "revoked": ft.revoked_steps,
                   "count": ft.step_count, "commits": [c[1] for c in ft.commit_times]}
            ft.finish()
        return out

    got = {}
    for defer in (True, False):
        with thread_coordinator(2) as coord:
            got[defer] = run_each([lambda i=i, c=coord, d=defer: run(i, c, d) for i in range(2)])
    for i in range(2):
        a, b = got[True][i], got[False][i]
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
        assert torch.equal(a["w"], b["w"]), "deferral changed the result"
        assert a["applied"] == [(s, (0, 1)) for s in range(steps)], a["applied"]
        assert a["count"] == steps and a["revoked"] == 0 and a["commits"] == list(range(1, steps + 1)), a
    assert torch.equal(got[True][0]["w"], got[True][1]["w"])
    torch.testing.assert_close(got[True][0]["w"], _replay(got[True][0]["applied"]), rtol=1e-12, atol=1e-12)


def test_a_step_refused_after_it_was_applied_is_revoked_and_trained_again() -> None:
    """Member 2 leaves inside step 3 after its all_reduce, without voting: members 0 and 1 voted and applied step 3
    provisionally; the coordinator announces the generation without member 2 before any decision, so step 3 is
    refused -- both revert it (weights, optimizer state, log) and train it again, with two members."""
    steps, leave_at = 6, 3

    def run(i: int, coord: Coordinator) -> dict[str, Any]:
        trainer = _Trainer()

        def leave(ft: FaultTolerant, s: int) -> None:
            if i == 2 and s == leave_at:
                raise _Leave

        with _member(coord, i, trainer) as ft:
            _train(ft, trainer, steps, inside=leave)
            out = {"w": trainer.w.clone(), "m": trainer.m.clone(), "applied": list(trainer.applied),
                   "revoked": ft.revoked_steps}
            ft.finish()
        return out

    with thread_coordinator(3, min_size=1) as coord:
        res = run_each([lambda i=i: run(i, coord) for i in range(3)])
    assert isinstance(res[2], _Leave), res[2]
    want = [(s, (0, 1, 2) if s < leave_at else (0, 1)) for s in range(steps)]
    for i in (0, 1):
        r = res[i]
        assert not isinstance(r, BaseException), r
        assert r["revoked"] == 1, r["revoked"]
        assert r["applied"] == want, r["applied"]
        torch.testing.assert_close(r["w"], _replay(want), rtol=1e-12, atol=1e-12)
    assert torch.equal(res[0]["w"], res[1]["w"]) and torch.equal(res[0]["m"], res[1]["m"])


def test_finish_raises_when_the_last_step_is_revoked_and_training_it_again_finishes() -> None:
    steps = 3

    def run(i: int, coord: Coordinator) -> Any:
        trainer = _Trainer()

        def leave(ft: FaultTolerant, s: int) -> None:
            if i == 1 and s == steps - 1:
                raise _Leave

        with _member(coord, i, trainer) as ft:
            while ft.step_count < steps:  # no confirm(): the last step is still provisional after the loop
                with ft.step() as step:
                    s, members = ft.step_count, tuple(ft.members)
                    g = _grad(s, ft.member_id)
                    ft.all_reduce(g, ReduceOp.AVG)
                    leave(ft, s)
                    if step.commit():
                        trainer.apply(s, members, g)
            with pytest.raises(StepRevoked, match="was refused"):
                ft.finish()
            revoked_at = ft.step_count
            _train(ft, trainer, steps)
            ft.finish()
            return revoked_at, list(trainer.applied)

    with thread_coordinator(2, min_size=1) as coord:
        res = run_each([lambda i=i: run(i, coord) for i in range(2)])
    assert isinstance(res[1], _Leave), res[1]
    assert res[0] == (steps - 1, [(0, (0, 1)), (1, (0, 1)), (2, (0,))]), res[0]


def test_a_transient_error_after_a_committed_provisional_step_leaves_the_group() -> None:
    """Member 1 raises a transient error after ``step.commit()`` returned True for step 1: the step was committed (both
    voted), its update may be half-applied, so member 1 leaves; member 0 goes on alone."""

    def run(i: int, coord: Coordinator) -> Any:
        trainer = _Trainer()

        def fail(ft: FaultTolerant, s: int) -> None:
            if i == 1 and s == 1:
                raise CommAborted("injected after a provisional commit")

        ft = _member(coord, i, trainer)
        try:
            _train(ft, trainer, 3, after_commit=fail)
            ft.finish()
            return list(trainer.applied)
        finally:
            ft.close()

    with thread_coordinator(2, min_size=1) as coord:
        res = run_each([lambda i=i: run(i, coord) for i in range(2)])
    assert isinstance(res[1], CommAborted), res[1]
    assert any("it left the group" in n for n in getattr(res[1], "__notes__", [])), res[1]
    assert res[0] == [(0, (0, 1)), (1, (0, 1)), (2, (0,))], res[0]


def test_defer_commit_needs_the_state_callbacks() -> None:
    with pytest.raises(ValueError, match="defer_commit must be a bool"):
        FaultTolerantConfig(defer_commit=1)  # type: ignore[arg-type]
    with thread_coordinator(1) as coord, pytest.raises(ValueError, match="needs state_dict and load_state_dict"):
        thread_member(coord, 0, min_size=1, defer_commit=True)
    # refused before any connection: an FT-HSDP soak with deferral stalled after a failover (see provisional.py)
    with pytest.raises(ValueError, match="replica groups of 2 ranks is not supported yet"):
        FaultTolerant(FaultTolerantConfig(coordinator="127.0.0.1:1", token="t", replica_group=0, group_rank=0,
                                          group_size=2, defer_commit=True),
                      state_dict=dict, load_state_dict=lambda s: None)


class _Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_state_snapshots_are_deep_copies_taken_on_a_worker_that_reuse_released_buffers() -> None:
    import threading

    w = torch.arange(6.0).reshape(2, 3)
    view = w.t()  # not contiguous
    od = collections.OrderedDict(w=w)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"model": od, "opt": [_Pair(view, 3), (torch.ones(2), "x")], "lr": 0.1}
    snaps = StateSnapshots()
    try:
        snaps.begin(state)
        first = snaps.done()
        assert first["model"]._metadata == {"": {"version": 1}} and type(first["model"]) is collections.OrderedDict
        assert isinstance(first["opt"][0], _Pair) and first["opt"][0].b == 3 and first["opt"][1][1] == "x"
        assert torch.equal(first["opt"][0].a, view) and first["opt"][0].a.is_contiguous()
        assert [t.name for t in threading.enumerate() if t.name.startswith("torchnext-ft-snapshot")], "no worker"
        ptr = first["model"]["w"].data_ptr()
        w.add_(1)  # the live state moves on; the copy does not
        assert torch.equal(first["model"]["w"], torch.arange(6.0).reshape(2, 3))
        snaps.begin(state)
        second = snaps.done()  # the first copy is held (not released): fresh buffers
        assert second["model"]["w"].data_ptr() not in (ptr, w.data_ptr()) and torch.equal(second["model"]["w"], w)
        snaps.release(first)
        snaps.begin(state)
        third = snaps.done()
        assert third["model"]["w"].data_ptr() == ptr, "a released copy's buffers were not reused"
        assert torch.equal(third["model"]["w"], w)
        snaps.begin(state)
        snaps.discard()  # begun and not taken: released
        snaps.begin(state)
        assert snaps.done()["model"]["w"].data_ptr() not in (second["model"]["w"].data_ptr(), w.data_ptr())
    finally:
        snaps.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("torchnext-ft-snapshot")], "worker left"
