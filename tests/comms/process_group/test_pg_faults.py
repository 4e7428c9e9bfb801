"""Failures through a torchnext process group: ``abort()`` unblocks a ``dist.all_reduce`` in flight; a peer killed in
DDP's backward neither crashes nor hangs the survivor (PeerFailure at the next call, a dump naming the missing
rank); a 3-rank desync issued through ``dist.*`` leaves dumps that PyTorch's torchfrtrace and ours read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext.comms import CommAborted, CommTimeout, PeerFailure
from torchnext.comms.flight_recorder import analyze_dir
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.timeout(300)


def _init(ctx: RankContext, dump_dir: str | None = None, timeout_s: float = 60.0) -> None:
    if dump_dir is not None:
        os.environ["TORCHNEXT_FR_DUMP_DIR"] = dump_dir
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=timeout_s))


# ----------------------------------------------------------------------------------------------------- abort
def abort_body(ctx: RankContext) -> dict[str, Any]:
    _init(ctx)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        pg = dist.group.WORLD
        aborted_at: list[float] = []

        def abort_later() -> None:
            time.sleep(0.3)
            aborted_at.append(time.monotonic())
            pg.abort()  # type: ignore[union-attr]

        threading.Thread(target=abort_later, daemon=True).start()
        try:
            dist.all_reduce(torch.ones(4))  # rank 1 never joins it
        except CommAborted:
            out["unblocked_s"] = time.monotonic() - aborted_at[0]
        try:
            dist.all_reduce(torch.ones(4))
        except CommAborted as exc:
            out["next_call"] = str(exc)
        ctx.store.set("rank0_done", "1")
    else:
        ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def test_abort_unblocks_a_dist_all_reduce_in_flight() -> None:
    res = run_ranks(abort_body, 2, timeout=120)
    assert res[0]["unblocked_s"] < 0.1, res[0]
    assert "refused" in res[0]["next_call"]


# ---------------------------------------------------------------------------------------- kill inside DDP
def ddp_kill_body(ctx: RankContext, dump_dir: str) -> list[tuple[Any, ...]]:
    _init(ctx, dump_dir, timeout_s=30)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    step = [0]
    if ctx.rank == 1:
        def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
            if step[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # while DDP's bucket all_reduces are in flight
            return grad

        model[2].weight.register_hook(die_in_backward)
    events: list[tuple[Any, ...]] = []
    for s in range(6):
        step[0] = s
        t0 = time.monotonic()
        try:
            ddp(torch.randn(4, 64)).square().mean().backward()
        except Exception as exc:
            events.append(("raised", s, type(exc).__name__, isinstance(exc, PeerFailure), time.monotonic() - t0))
            break
        finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters() if p.grad is not None)
        events.append(("ok", s, finite))
        ddp.zero_grad()
    return events


def test_peer_killed_during_ddp_backward(tmp_path: Path) -> None:
    res = run_ranks(ddp_kill_body, 2, args=(str(tmp_path),), allow_exit=[1], timeout=120)
    events = res[0]  # the survivor returned: no crash, no hang
    assert events[:3] == [("ok", 0, True), ("ok", 1, True), ("ok", 2, True)]
    # The kill lands in step 3's bucket all_reduces. Either a later bucket of step 3 is the next call into the
    # group (it raises), or step 3's last bucket failed: then backward returned with that bucket's gradients
    # marked invalid (NaN: a future must never raise into DDP) and step 4's first call raises.
    if events[3][0] == "ok":
        assert events[3] == ("ok", 3, False)
        raised = events[4]
    else:
        raised = events[3]
    kind, step, name, is_peer_failure, seconds = raised
    assert (kind, name, is_peer_failure) == ("raised", "PeerFailure", True) and step in (3, 4)
    assert seconds < 5.0  # gloo sees the reset connection at once; far below the 30 s op timeout
    report = analyze_dir(tmp_path)
    assert report.issues and report.issues[0].kind == "missing_ranks" and report.issues[0].ranks == [1]


# -------------------------------------------------------------------------------------- desync + torchfrtrace
def desync_body(ctx: RankContext, dump_dir: str) -> str:
    _init(ctx, dump_dir, timeout_s=3)
    for _ in range(2):
        dist.all_reduce(torch.ones(4))
    if ctx.rank == 2:  # skips the third all_reduce: dumps on SIGUSR1 (the recorder's handler), then leaves
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not (Path(dump_dir) / "torchnext_fr_trace_rank_2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx.store.wait(["timed_out/0", "timed_out/1"], timedelta(seconds=60))  # stay up: a timeout, not a crash
        return "dumped on signal"
    try:
        dist.all_reduce(torch.ones(4))
    except CommTimeout:
        ctx.store.set(f"timed_out/{ctx.rank}", "1")
        return "timed out"
    return "completed?"


def test_desync_through_dist_is_read_by_torchfrtrace_and_ours(tmp_path: Path) -> None:
    res = run_ranks(desync_body, 3, args=(str(tmp_path),), timeout=120)
    assert res == ["timed out", "timed out", "dumped on signal"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"torchnext_fr_rank_{r}.json" for r in range(3)] + [f"torchnext_fr_trace_rank_{r}" for r in range(3)])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "missing ranks: {2}" in proc.stdout + proc.stderr
    issue = analyze_dir(tmp_path).issues[0]
    assert (issue.kind, issue.ranks, issue.op) == ("missing_ranks", [2], "all_reduce")
