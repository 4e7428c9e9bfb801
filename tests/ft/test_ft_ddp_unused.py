"""Fault-tolerant DDP with a parameter that only some replica groups use (mixture-of-experts routing).

DDP's ``find_unused_parameters`` all-reduces which parameters were used, then skips the "globally unused" ones. That
map must be reduced across the live replica groups: reduced on this process alone, a parameter unused here but used
elsewhere would keep no gradient here while the others apply the average -- the replicas drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from torchnext.comms import native as native_ext
from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.testing.ft_workload import FTJob

pytestmark = [pytest.mark.timeout(120)]


@dataclass
class _Spec:
    coordinator: str
    token: str
    member_id: int
    steps: int = 3


class _TwoExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = (self.a * x).sum()
        return out + (self.b * x).sum() if use_b else out


def _worker(spec: _Spec) -> dict[str, Any]:
    from torchnext.ft import DistributedDataParallel, FaultTolerant, FaultTolerantConfig

    torch.set_num_threads(1)
    model = _TwoExperts()
    ft = FaultTolerant(FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id))
    try:
        net = DistributedDataParallel(model, ft, find_unused_parameters=True)  # not every group uses b
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        while ft.step_count < spec.steps:
            with ft.step() as st:
                opt.zero_grad(set_to_none=True)
                x = torch.full((4,), float(spec.member_id + 1), dtype=torch.float64)
                net(x, use_b=spec.member_id == 1).backward()  # only member 1 uses b
                if st.commit():
                    opt.step()
        return {"a": model.a.detach().tolist(), "b": model.b.detach().tolist(), "steps": ft.step_count,
                "counts": net.native_counts()}
    finally:
        ft.finish()


def test_a_parameter_used_by_one_replica_group_gets_the_average_on_all() -> None:
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=2))) as coord, \
            FTJob() as job:
        for m in (0, 1):
            job.launch(_Spec(coord.address, coord.token, m), _worker)  # type: ignore[arg-type]
        reports = job.wait([0, 1], timeout=90)
    assert sorted(reports) == [0, 1], job.errors
    # SGD lr=1 from zeros, 3 steps: a's gradient averages (1 + 2) / 2; b's (0 + 2) / 2 -- on both members
    for m in (0, 1):
        assert reports[m]["steps"] == 3
        assert reports[m]["a"] == [-4.5] * 4, (m, reports[m])
        assert reports[m]["b"] == [-3.0] * 4, (m, reports[m])
        if native_ext.status().available:  # the used map went through the C++ route (csrc/ddp.cpp)
            assert reports[m]["counts"]["used_map_native"] >= 3, reports[m]["counts"]
