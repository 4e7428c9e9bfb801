"""End of training: ``FaultTolerant.finish()`` lets members leave in any order without the others reconfiguring.

Real members (threads, Gloo over loopback) and an in-process coordinator, as in the README example."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torchnext.comms import ReduceOp
from torchnext.ft import (
    Coordinator,
    CoordinatorConfig,
    FaultTolerant,
    FaultTolerantConfig,
    JobFinished,
    MembershipConfig,
)
from torchnext.ft.membership import Rejected
from torchnext.testing import run_each

pytestmark = pytest.mark.timeout(120)


def _train(coord: Coordinator, i: int, steps: int, n: int = 3) -> FaultTolerant:
    model = torch.nn.Linear(4, 1)
    torch.nn.init.constant_(model.weight, 0.5)
    ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, member_id=i, min_size=n,
                                           timeout_s=30.0),
                       state_dict=lambda: {"model": model.state_dict()},
                       load_state_dict=lambda s: model.load_state_dict(s["model"]))
    while ft.step_count < steps:
        with ft.step() as step:
            model(torch.full((2, 4), float(ft.rank + 1))).sum().backward()
            for p in model.parameters():
                ft.all_reduce(p.grad, ReduceOp.AVG)
            step.commit()
            model.zero_grad()
    return ft



def test_members_finish_in_any_order_without_reconfiguring() -> None:
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=3, initial_size=3))) as coord:

        def member(i: int) -> int:
            ft = _train(coord, i, 3)
            time.sleep(0.4 * i)  # staggered ends; member 2 just closes (as a crashed-after-the-end process would)
            steps = ft.step_count
            if i < 2:
                ft.finish()
            else:
                ft.close()
            return steps

        out = run_each([lambda i=i: member(i) for i in range(3)], timeout=90)
        assert out == {0: 3, 1: 3, 2: 3}, out
        assert coord.wait_until(lambda c: len([h for h in c.history() if h["event"] in ("finish", "left_after_finish")]) == 3, 10)
        events = [h["event"] for h in coord.history()]
        assert coord.finished_step == 3 and coord.generation == 1
        assert events.count("finish") == 2 and events.count("left_after_finish") == 1
        assert "failure" not in events and events.count("generation") == 1, events
        with pytest.raises(Rejected) as exc:  # nobody joins a finished job
            FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, min_size=1),
                          state_dict=dict, load_state_dict=lambda s: None)
        assert exc.value.code == "finished"


def test_member_training_past_the_finish_gets_job_finished() -> None:
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=2))) as coord:
        finished = threading.Event()

        def first() -> int:
            ft = _train(coord, 0, 2, n=2)
            ft.finish()
            finished.set()
            return ft.step_count

        def second() -> str:
            ft = _train(coord, 1, 2, n=2)
            assert finished.wait(30)
            try:
                _train_more(ft)
            except JobFinished as exc:
                return str(exc)
            finally:
                ft.close()
            return "no error"

        out = run_each([first, second], timeout=90)
        assert out[0] == 2 and "finished at step 2" in str(out[1]), out
        assert coord.generation == 1


def _train_more(ft: FaultTolerant) -> None:
    while True:  # one more step than the job has: its collective fails (the peer left), the report is refused
        with ft.step() as step:
            t = torch.ones(3)
            ft.all_reduce(t)
            step.commit()
