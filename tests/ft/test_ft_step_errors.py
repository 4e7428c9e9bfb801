"""What ends a ``ft.step()`` attempt: transient failures are retried (at most ``max_retries`` in a row), deterministic
errors are raised on every member without a new generation.

Real members (threads, Gloo over loopback) and an in-process coordinator; every wait is bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from torchnext.comms import CollectiveMismatch, CommAborted, CommTimeout, HookError, PeerFailure, ReduceOp
from torchnext.ft import (
    Coordinator,
    FailureKind,
    FaultTolerantConfig,
    MembershipConfig,
    QuorumLost,
    RetriesExhausted,
    StepFailed,
    classify_failure,
    register_failure_kind,
)
from torchnext.ft.errors import raised_on_every_member
from torchnext.ft.membership import Membership
from torchnext.testing import run_each
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)

N = 2
BOUND_S = 60.0  # every member thread must be done by then


def _events(coord: Coordinator, kind: str) -> list[dict[str, Any]]:
    return [h for h in coord.history() if h["event"] == kind]


def _generations(coord: Coordinator) -> list[int]:
    return [h["gen"] for h in _events(coord, "generation")]


# ------------------------------------------------------------------------------------------------ classification
def test_classification_registry() -> None:
    transient = [PeerFailure("x", peer=1), CommTimeout("x"), CommAborted("x"), torch.distributed.DistBackendError("x")]
    for exc in transient:
        assert classify_failure(exc) is FailureKind.TRANSIENT, exc
    deterministic = [CollectiveMismatch("x"), ValueError("x"), TypeError("x"), HookError("x", hook=print),
                     RuntimeError("user code"), KeyError("k")]
    for exc in deterministic:
        assert classify_failure(exc) is FailureKind.DETERMINISTIC, exc
    assert classify_failure(QuorumLost("x")) is FailureKind.FATAL
    assert classify_failure(StepFailed("x")) is FailureKind.FATAL
    assert classify_failure(KeyboardInterrupt()) is FailureKind.LEAVE
    assert raised_on_every_member(CollectiveMismatch("x", field="input_sizes"))
    assert not raised_on_every_member(CollectiveMismatch("x", field="arrival", breaks_communicator=True))
    assert not raised_on_every_member(ValueError("x"))

    class Flaky(OSError):
        pass

    assert classify_failure(Flaky()) is FailureKind.DETERMINISTIC
    register_failure_kind(Flaky, FailureKind.TRANSIENT)
    assert classify_failure(Flaky()) is FailureKind.TRANSIENT
    with pytest.raises(TypeError):
        register_failure_kind(int, FailureKind.TRANSIENT)  # type: ignore[arg-type]


def test_max_retries_is_validated() -> None:
    assert FaultTolerantConfig().max_retries == 100
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="max_retries"):
            FaultTolerantConfig(max_retries=bad)  # type: ignore[arg-type]
    FaultTolerantConfig(max_retries=0)


def test_membership_end_fails_the_job_with_the_code() -> None:
    st = Membership(MembershipConfig(min_size=2, initial_size=2))
    for m in (0, 1):
        st.join(m, 0, 0.0)
    st.tick(0.0)
    assert st.gen == 1
    st.outbox.clear()
    st.report_failure(1, 1, "ValueError: bad batch", 0.1, end="step_failed")
    assert st.gen == 1 and st.fatal is not None and "member 1" in st.fatal
    assert sorted(m for m, msg in st.outbox if msg["t"] == "fatal" and msg["code"] == "step_failed") == [0, 1]
    assert not [h for h in st.history if h["event"] == "report"]


# --------------------------------------------------------------------------------------------- deterministic
def test_collective_mismatch_is_raised_on_every_member_without_a_new_generation() -> None:
    """Consistency mode on; member 1 all-reduces 8 elements where member 0 all-reduces 4: both raise
    CollectiveMismatch out of ft.step(), nobody reports, the generation stays; the next step commits in it."""
    with thread_coordinator(N) as coord:

        def member(i: int) -> tuple[BaseException | None, int, int]:
            ft = thread_member(coord, i, min_size=N, check_collectives=True)
            try:
                err: BaseException | None = None
                try:
                    with ft.step() as step:
                        ft.all_reduce(torch.ones(4 if i == 0 else 8), ReduceOp.SUM)
                        step.commit()
                except CollectiveMismatch as exc:
                    err = exc
                gen = ft.generation
                with ft.step() as step:  # the Communicator is still usable: a matching step commits
                    t = torch.ones(4)
                    ft.all_reduce(t, ReduceOp.SUM)
                    assert step.commit() and t.tolist() == [2.0] * 4
                return err, gen, ft.step_count
            finally:
                ft.finish()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert not isinstance(out[i], BaseException), out[i]
            err, gen, steps = out[i]
            assert isinstance(err, CollectiveMismatch), (i, err)
            assert err.field == "input_sizes"
            assert any("deterministic error" in n and "every member raises it" in n for n in err.__notes__)
            assert gen == 1 and steps == 1
        assert _generations(coord) == [1]
        assert not _events(coord, "report") and not _events(coord, "fatal")


def test_collective_mismatch_through_process_group_ends_the_step() -> None:
    """ft.process_group records failures instead of raising them; a mismatch it records must still end the step
    with CollectiveMismatch on every member (not a reconfiguration and a retry)."""
    with thread_coordinator(N) as coord:

        def member(i: int) -> tuple[BaseException | None, bool, int]:
            ft = thread_member(coord, i, min_size=N, check_collectives=True)
            pg = ft.process_group
            try:
                err: BaseException | None = None
                t = torch.ones(4 if i == 0 else 8)
                try:
                    with ft.step() as step:
                        pg.allreduce([t]).wait()  # recorded, never raised here
                        step.commit()
                except CollectiveMismatch as exc:
                    err = exc
                return err, bool(torch.isnan(t).all()), ft.generation
            finally:
                ft.close()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert not isinstance(out[i], BaseException), out[i]
            err, nan, gen = out[i]
            assert isinstance(err, CollectiveMismatch), (i, err)
            assert nan and gen == 1
        assert _generations(coord) == [1]
        assert not _events(coord, "report")


def test_user_error_on_one_member_ends_the_step_on_every_member() -> None:
    """Member 1's step body raises ValueError before its all_reduce; member 0, blocked in the all_reduce, must not
    wait for a timeout or a reconfiguration: it raises StepFailed naming member 1 and the error, at once."""
    with thread_coordinator(N) as coord:

        joined = threading.Barrier(N)

        def member(i: int) -> tuple[BaseException | None, float]:
            ft = thread_member(coord, i, min_size=N, timeout_s=30.0)
            joined.wait(BOUND_S)  # both joined first: else member 0 may still be joining when the job ends (its
            start = time.monotonic()  # constructor then raises StepFailed, as it should, before this test's step)
            try:
                with ft.step() as step:
                    if i == 1:
                        raise ValueError("bad batch on member 1")
                    ft.all_reduce(torch.ones(4), ReduceOp.SUM)
                    step.commit()
                return None, time.monotonic() - start
            except (ValueError, StepFailed) as exc:
                return exc, time.monotonic() - start
            finally:
                ft.close()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        err1, _ = out[1]
        assert isinstance(err1, ValueError) and not isinstance(err1, StepFailed), err1
        assert any("the job was ended" in n for n in err1.__notes__)
        err0, waited = out[0]
        assert isinstance(err0, StepFailed), err0
        assert "member 1" in str(err0) and "bad batch on member 1" in str(err0)
        assert waited < 20.0, f"member 0 waited {waited:.1f}s (op timeout 30 s)"
        assert _generations(coord) == [1]
        assert not _events(coord, "report")
        assert [h["code"] for h in _events(coord, "fatal")] == ["step_failed"]


# ------------------------------------------------------------------------------------------------- transient
def test_transient_failure_is_retried_until_the_step_commits() -> None:
    """PeerFailure raised in the body on the first 2 attempts at steps 1 and 2 (max_retries=2): every failure is
    swallowed, the group reconfigures, the steps commit; 4 failures in all but never 3 in a row (a commit resets)."""
    with thread_coordinator(N) as coord:

        def member(i: int) -> tuple[int, int, int]:
            ft = thread_member(coord, i, min_size=N, max_retries=2)
            tries: dict[int, int] = {}
            failed = 0
            try:
                while ft.step_count < 4:
                    s = ft.step_count
                    tries[s] = tries.get(s, 0) + 1
                    assert tries[s] <= 3, f"step {s} attempted {tries[s]} times"
                    with ft.step() as step:
                        if i == 0 and s in (1, 2) and tries[s] <= 2:
                            raise PeerFailure(f"injected at step {s}, attempt {tries[s]}", op="all_reduce")
                        ft.all_reduce(torch.ones(2), ReduceOp.SUM)
                        step.commit()
                    failed += step.error is not None
                return ft.step_count, ft.generation, failed
            finally:
                ft.finish()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert not isinstance(out[i], BaseException), out[i]
        assert out[0][0] == out[1][0] == 4
        assert out[0][2] == 4 and out[0][1] >= 5  # one new generation per injected failure
        assert len(_events(coord, "report")) >= 4
        assert not _events(coord, "fatal")


def test_retry_cap_raises_retries_exhausted_on_every_member() -> None:
    """Every attempt at step 1 fails (PeerFailure on member 0): after max_retries=2 retries -- the 3rd failed
    attempt -- every member raises RetriesExhausted naming the step and the last failures; nothing loops."""
    with thread_coordinator(N) as coord:

        def member(i: int) -> tuple[BaseException | None, int]:
            ft = thread_member(coord, i, min_size=N, max_retries=2)
            attempts = 0
            try:
                while ft.step_count < 3:
                    attempts += 1
                    assert attempts <= 10, "the retry cap did not trigger"
                    with ft.step() as step:
                        if i == 0 and ft.step_count == 1:
                            raise PeerFailure(f"injected, attempt {attempts}", op="all_reduce")
                        ft.all_reduce(torch.ones(2), ReduceOp.SUM)
                        step.commit()
                return None, attempts
            except RetriesExhausted as exc:
                return exc, attempts
            finally:
                ft.close()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        err0, attempts0 = out[0]
        assert isinstance(err0, RetriesExhausted), err0
        assert err0.step == 1 and err0.attempts == 3 and attempts0 == 4  # 1 commit + 3 failed attempts
        assert "step 1 failed 3 attempts in a row (max_retries=2)" in str(err0)
        assert len(err0.failures) == 3 and all("PeerFailure: " in f and "injected" in f for f in err0.failures)
        err1, _ = out[1]
        assert isinstance(err1, RetriesExhausted), err1
        assert "step 1 failed 3 attempts in a row" in str(err1)
        assert [h["code"] for h in _events(coord, "fatal")] == ["retries_exhausted"]
