"""``torchnext.ft.DistributedDataParallel``'s pinned bucket layout: every member buckets alike whenever it joined.

torch's DDP with ``find_unused_parameters=False`` starts from one bucket and rebuilds its buckets once, before its
second forward, in the order gradients became ready -- a replica group joining a running job would bucket its first
step unlike the survivors' (one all-reduce against their several, or the same sizes holding other parameters). FT-DDP
builds the layout torch builds for ``find_unused_parameters=True`` and answers the one rebuild with it (ft/ddp.py).

Real members (threads, Gloo over loopback) and an in-process coordinator; every wait is bounded.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchnext.comms import native as native_ext
from torchnext.comms.communicator import Communicator
from torchnext.ft import Coordinator, DistributedDataParallel, FaultTolerant
from torchnext.testing import run_each
from torchnext.testing.ft_parallel import ddp_expected_weights, ddp_gradient
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)

N_PARAMS, DIM = 4, 32  # ddp_gradient's shapes: float64, 256 bytes a parameter
CAP_MB = 2 * DIM * 8 / (1 << 20)  # two parameters a bucket
PINNED = [[2, 3], [0, 1]]
"""torch's construction layout with find_unused_parameters=True: buckets filled over the parameters in order, then
reversed (bucket 0 is reduced first). torch's rebuild would take the gradients' ready order, [[3, 2], [1, 0]]."""
JOIN_AT = 3  # the joiner starts once the survivors committed this many steps: past torch's rebuild (before step 2)
SURVIVORS = (0, 1)
JOINER = 2

_FORWARD = threading.Lock()  # DDP forwards of member threads one at a time (see tests/ft/test_ft_vote_early.py)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.zeros(DIM, dtype=torch.float64)) for _ in range(N_PARAMS))

    def forward(self, cs: list[torch.Tensor]) -> torch.Tensor:
        # parameter i's term is built in order: backward reaches them in reverse (3 first)
        return sum(((w * c).sum() for w, c in zip(self.ws, cs, strict=True)), torch.zeros((), dtype=torch.float64))


def _layout(ddp: nn.parallel.DistributedDataParallel, params: list[nn.Parameter]) -> list[list[int]]:
    """A torch DDP's buckets as parameter indices (as ``ft.DistributedDataParallel.bucket_layout``)."""
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


# ------------------------------------------------------------------------------------------- a joiner
def _member(i: int, coord: Coordinator, *, find_unused: bool, go: threading.Event, stop: list[int | None],
            ) -> dict[str, Any]:
    """Survivors (0, 1) train from the start; once they committed ``JOIN_AT`` steps the joiner (2, from garbage)
    builds its FaultTolerant and DDP while they train, joins (healing) and, at its first commit, sets the last step
    for everyone."""
    joiner = i == JOINER
    model = _Model()
    if joiner:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(12345.0)  # healing must overwrite it
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if joiner:  # registering with the coordinator makes the others wait for this member: not before the join step
        assert go.wait(60), "the survivors never reached the join step"
    ft = thread_member(coord, i, min_size=len(SURVIVORS), join=not joiner,
                       state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                       load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])))
    try:
        net = DistributedDataParallel(model, ft, bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
        out: dict[str, Any] = {"built": net.bucket_layout(), "layouts": [], "history": [],
                               "native": net.native_counts() is not None}
        if joiner:
            ft.join()  # built while the survivors train; healed here
        while stop[0] is None or ft.step_count < stop[0]:
            with ft.step() as step:
                s = ft.step_count
                members = sorted(m for g in ft.replica_groups for m in g)  # before the step: a grow changes them
                with _FORWARD:
                    loss = net([ddp_gradient(s, ft.member_id, k) for k in range(N_PARAMS)])
                loss.backward()
                if step.commit():
                    opt.step()
                    out["history"].append((s, members))
                    if joiner and stop[0] is None:
                        stop[0] = ft.step_count + 2
                opt.zero_grad()
            out["layouts"].append(net.bucket_layout())
            if ft.step_count >= JOIN_AT:
                go.set()
            if not joiner and stop[0] is None:
                time.sleep(0.01)  # leave the joiner time to arrive
        out["rebuilt_again"] = net.reducer._rebuild_buckets()
        log = net._get_ddp_logging_data()
        out["log"] = {k: log.get(k) for k in ("bucket_sizes", "rebuilt_per_bucket_param_indices")}
        out["params"] = [p.detach().clone() for p in model.parameters()]
        out["step"] = ft.step_count
        return out
    finally:
        if joiner and stop[0] is None:
            stop[0] = 0  # the joiner failed: let the survivors end
        ft.finish()


@pytest.fixture(params=[True, False], ids=["native", "python"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """``TORCHNEXT_NATIVE_PG``: the C++ comm hook, or the Python hook."""
    if request.param and not native_ext.status().available:
        pytest.skip(f"the native extension cannot be built here: {native_ext.status().reason}")
    monkeypatch.setenv("TORCHNEXT_NATIVE_PG", "1" if request.param else "0")
    return bool(request.param)


@pytest.mark.parametrize("find_unused", [False, True], ids=["all-used", "find-unused"])
def test_a_joiner_buckets_like_the_survivors_and_all_end_equal_to_the_replay(native: bool, find_unused: bool) -> None:
    go, stop = threading.Event(), list[int | None]([None])
    with thread_coordinator(len(SURVIVORS), min_size=len(SURVIVORS)) as coord:
        out = run_each([lambda i=i: _member(i, coord, find_unused=find_unused, go=go, stop=stop)
                        for i in (*SURVIVORS, JOINER)], timeout=90)
    for i in range(3):
        assert not isinstance(out[i], BaseException), out[i]
    first_join = out[JOINER]["history"][0]
    assert first_join[0] >= JOIN_AT and first_join[1] == [*SURVIVORS, JOINER], out[JOINER]["history"]
    history = out[0]["history"]
    assert [s for s, _ in history] == list(range(out[0]["step"])), history
    assert out[1]["history"] == history and out[JOINER]["history"] == history[-len(out[JOINER]["history"]):]
    replay = ddp_expected_weights([members for _, members in history])
    for i in range(3):
        for k, (got, want) in enumerate(zip(out[i]["params"], replay, strict=True)):
            assert torch.equal(got, want), f"member {i}: parameter {k} differs from the exact replay"
    for i in range(3):
        o = out[i]
        assert o["native"] is native
        assert o["built"] == PINNED, f"member {i}: the layout at construction {o['built']}"
        assert all(lay == PINNED for lay in o["layouts"]), f"member {i}: the layout changed {o['layouts']}"
        assert o["rebuilt_again"] is False
        assert o["log"]["bucket_sizes"] == "512, 512", o["log"]
        # find_unused_parameters=False: torch's one rebuild ran (at construction), with the pinned layout
        assert o["log"]["rebuilt_per_bucket_param_indices"] == (None if find_unused else "2 3, 0 1"), o["log"]


# ------------------------------------------------------------------------------------- one member
@pytest.fixture
def ft() -> Iterator[FaultTolerant]:
    """A one-member job."""
    with thread_coordinator(1) as coord, thread_member(coord, 0, min_size=1) as member:
        yield member
        member.finish()


_REFS = itertools.count()


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # over 2 MiB of float32: several buckets at torch's default caps (the first 1 MiB)
    return nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 64))


@pytest.mark.parametrize("caps", [{}, {"bucket_cap_mb": 1}, {"bucket_cap_mb_list": [1, 2]}],
                         ids=["default", "bucket_cap_mb", "bucket_cap_mb_list"])
def test_the_pinned_layout_is_torchs_construction_layout_with_find_unused_parameters(
        ft: FaultTolerant, caps: dict[str, Any]) -> None:
    local = Communicator(dist.HashStore(), 0, 1, name=f"layout-reference-{next(_REFS)}")
    try:
        ref_model = _mlp()
        ref = nn.parallel.DistributedDataParallel(ref_model, process_group=local.as_process_group(),
                                                  find_unused_parameters=True, **caps)
        want = _layout(ref, list(ref_model.parameters()))
    finally:
        local.shutdown()
    assert len(want) > 1, want
    net = DistributedDataParallel(_mlp(), ft, **caps)
    assert net.find_unused_parameters is False  # torch's default
    assert net.bucket_layout() == want


def test_static_graph_is_refused(ft: FaultTolerant) -> None:
    with pytest.raises(ValueError, match="static_graph=True is not supported"):
        DistributedDataParallel(_Model(), ft, static_graph=True)
    net = DistributedDataParallel(_Model(), ft)
    with pytest.raises(ValueError, match="static_graph is not supported"):
        net._set_static_graph()


def test_buffers_stay_local_and_any_other_broadcast_on_ddps_group_raises(ft: FaultTolerant) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net = DistributedDataParallel(model, ft, bucket_cap_mb=100 / (1 << 20))
    assert net.broadcast_buffers and net.will_sync_module_buffers()
    built = net.bucket_layout()
    for _ in range(3):  # each forward broadcasts the buffers on DDP's group: the one-rank group, no raise
        with ft.step() as step:
            net(torch.randn(4, 8)).sum().backward()
            assert step.commit()
    assert net.bucket_layout() == built and len(built) > 1
    for bad in ([torch.zeros(3)], [torch.zeros(sum(map(len, built)) + 1, dtype=torch.int64)],
                [torch.zeros(2, dtype=torch.int32)]):
        with pytest.raises(RuntimeError, match=r"a broadcast of .* on DDP's own group after construction"):
            net.process_group.broadcast(bad)
    # issued from C++ (as the Reducer's and DDP's buffer broadcasts are): torch's trampoline calls the Python method
    with pytest.raises(RuntimeError, match=r"a broadcast of .* on DDP's own group after construction"):
        dist._broadcast_coalesced(net.process_group, [torch.zeros(3)], 1 << 20, 0)


def test_without_torchs_bucket_config_it_falls_back_to_find_unused_parameters(
        ft: FaultTolerant, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torchnext.ft.ddp._answers_limits", lambda config: False)
    with pytest.warns(RuntimeWarning, match="running with find_unused_parameters=True"):
        net = DistributedDataParallel(_Model(), ft, bucket_cap_mb=CAP_MB)
    assert net.find_unused_parameters is True
    assert net.bucket_layout() == PINNED
    with ft.step() as step:
        net([ddp_gradient(0, 0, k) for k in range(N_PARAMS)]).backward()
        assert step.commit()
    assert net.bucket_layout() == PINNED
