"""Real multi-rank Gloo runs with scripted faults: the recorder dumps, the analyzer names the rank, seq and kind.

Every rank is a process started by the comms harness (``torchnext.testing.run_ranks``: parent-hosted store, bounded
waits, children always reaped). Communicators get a generous timeout (connecting under load can be slow); the op
that is meant to hang gets a short per-op timeout (``FAULT_S``) so each scenario ends in seconds.
"""

from __future__ import annotations

import json
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

from torchnext.cli import main as cli_main
from torchnext.comms import CommAborted, CommError, CommTimeout, Communicator, FlightRecorder
from torchnext.comms.flight_recorder.analysis import Report, analyze_dir
from torchnext.testing import RankContext, crash_now, run_ranks

FORMATS = ("json", "pickle")
FAULT_S = 2.0


def _setup(ctx: RankContext, d: str, *, timeout: float = 60.0, capacity: int = 2000) -> tuple[Communicator, FlightRecorder]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=timeout))
    fr = FlightRecorder.attach(comm, capacity=capacity, dump_dir=d, auto_dump_formats=FORMATS, record_frames=True)
    return comm, fr


def _dump(fr: FlightRecorder, d: str) -> None:
    for fmt in FORMATS:
        fr.dump(d + os.sep, format=fmt, reason="end of test")


def _wait_key(ctx: RankContext, key: str, seconds: float = 30.0) -> None:
    ctx.store.wait([key], timedelta(seconds=seconds))


def _analyze(d: Path) -> Report:
    report = analyze_dir(d)
    # the pickle flavour (for torchfrtrace) sits beside the JSON dumps and is skipped without --allow-pickle
    assert not [p for p in report.problems if p.skipped and "--allow-pickle" not in p.message], report.problems
    return report


def _first(report: Report) -> tuple[str, list[int], int | None, str | None, str]:
    i = report.issues[0]
    return i.kind, i.ranks, i.seq, i.op, i.pg


# ---------------------------------------------------------------------------------------------- rank bodies
def _stuck_in_compute(d: str, rank: int) -> None:
    """Where rank 2 "hangs" instead of entering the collective; leaves once SIGUSR1 made it dump."""
    target = os.path.join(d, f"torchnext_fr_rank_{rank}.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(target) and time.monotonic() < deadline:
        time.sleep(0.02)


def skip_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    fr.enable_dump_on_signal(signal.SIGUSR1)
    ctx.store.set(f"pid{ctx.rank}", str(os.getpid()))
    t = torch.ones(4)
    for _ in range(2):
        comm.all_reduce(t)
    if ctx.rank == 2:
        _stuck_in_compute(d, 2)  # skips all_reduce #3
        return None
    with pytest.raises(CommTimeout):
        comm.all_reduce(t, timeout=FAULT_S)
    if ctx.rank == 0:
        os.kill(int(ctx.store.get("pid2")), signal.SIGUSR1)  # what an operator (or launcher) does to a stuck rank
    return [str(p) for p in fr.last_dump_paths]


def op_mismatch_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    with pytest.raises(CommError):
        if ctx.rank == 1:
            comm.broadcast(t, 0, timeout=FAULT_S)
        else:
            comm.all_reduce(t, timeout=FAULT_S)
    return fr.last_dump_paths != []


def size_dtype_body(ctx: RankContext, d: str, kind: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    if kind == "size":  # rank 2 passes a bigger buffer: Gloo completes silently (a latent bug the analyzer finds)
        comm.broadcast(torch.ones(8 if ctx.rank == 2 else 4), 0)
    else:  # rank 2 passes int32 of the same byte size: Gloo reduces garbage silently
        comm.all_reduce(torch.ones(4, dtype=torch.int32 if ctx.rank == 2 else torch.float32))
    comm.all_reduce(t)
    _dump(fr, d)


def p2p_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    if ctx.rank == 0:
        try:
            comm.send(t, 1, timeout=1.5)  # rank 1 never posts the recv
        except CommTimeout:
            pass
        _dump(fr, d)
        ctx.store.set("sent", "1")
    else:
        _wait_key(ctx, "sent")
        _dump(fr, d)


def tagged_batch_body(ctx: RankContext, d: str) -> Any:
    from torchnext.comms import P2POp

    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    if ctx.rank == 0:
        try:  # two tagged sends in one batch; rank 1 only ever receives tag 8
            comm.batch_p2p([P2POp("send", t, 1, tag=7), P2POp("send", t.clone(), 1, tag=8)], timeout=1.5)
        except CommTimeout:
            pass
        _dump(fr, d)
        ctx.store.set("sent", "1")
    else:
        comm.recv(torch.empty(4), 0, tag=8)
        _wait_key(ctx, "sent")
        _dump(fr, d)


def window_signal_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    win = comm.new_window(torch.zeros(8))
    peer = 1 - ctx.rank
    win.put(torch.ones(2), peer, 0)
    if ctx.rank == 1:
        try:  # rank 0 never signals
            win.wait_signal(0, 1, timeout=1.0)
        except CommTimeout:
            pass
    comm.all_reduce(t)  # collectives stay aligned across ranks around the one-sided ops
    _dump(fr, d)
    win.close()


def straggler_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    for i in range(4):
        if i == 2 and ctx.rank == 1:
            time.sleep(1.5)
        comm.all_reduce(t)
    _dump(fr, d)


def killed_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    for _ in range(2):
        comm.all_reduce(t)
    if ctx.rank == 2:
        crash_now()
    with pytest.raises(CommError):
        comm.all_reduce(t, timeout=3 * FAULT_S)
    return [str(p) for p in fr.last_dump_paths]


def abort_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    if ctx.rank == 1:
        _wait_key(ctx, "aborted")
        return None
    threading.Timer(0.3, comm.abort, args=("operator gave up",)).start()
    with pytest.raises(CommAborted):
        comm.all_reduce(t)
    ctx.store.set("aborted", "1")
    dump = json.loads((Path(d) / "torchnext_fr_rank_0.json").read_text())
    return dump["dump_reason"], [e["state"] for e in dump["entries"]], [e["state"] for e in fr.entries()]


def split_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    comm.all_reduce(t)
    child = comm.split_by_color(ctx.rank // 2)
    assert child is not None and child.flight_recorder is fr
    comm.all_reduce(t)
    child.all_reduce(t)
    if ctx.rank == 3:  # skips its child's second all_reduce
        _wait_key(ctx, "child_timed_out")
    elif ctx.rank == 2:
        with pytest.raises(CommTimeout):
            child.all_reduce(t, timeout=FAULT_S)
        ctx.store.set("child_timed_out", "1")
    else:
        child.all_reduce(t)
    _dump(fr, d)
    return child.name


def wrap_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d, capacity=8)
    t = torch.ones(4)
    for _ in range(20):
        comm.all_reduce(t)
    _dump(fr, d)
    os.environ["TORCHNEXT_FR_BUFFER_SIZE"] = "0"
    off = Communicator(ctx.store, ctx.rank, ctx.world_size, name="off", flight_recorder=True)
    off.all_reduce(t)
    rec = off.flight_recorder
    no_hooks = not off._pre_hooks.snapshot and not off._post_hooks.snapshot
    return rec is not None and not rec.enabled and rec.entries() == [] and no_hooks and fr.dropped == 12


def generations_body(ctx: RankContext, d: str) -> Any:
    comm, fr = _setup(ctx, d)
    t = torch.ones(4)
    for _ in range(2):
        comm.all_reduce(t)
    if ctx.rank == 2:  # leaves the job; the others rebuild without it (generation 1)
        _dump(fr, d)
        return None
    comm1 = Communicator(ctx.store, ctx.rank, 2, name="world_g1", timeout=timedelta(seconds=60))
    fr.add_communicator(comm1, generation=1)
    comm1.all_reduce(t)
    if ctx.rank == 0:
        with pytest.raises(CommTimeout):
            comm1.all_reduce(t, timeout=FAULT_S)
        ctx.store.set("g1_timed_out", "1")
    else:
        _wait_key(ctx, "g1_timed_out")
        _dump(fr, d)
    return None


# ---------------------------------------------------------------------------------------------- tests
def test_missing_rank_skipped_collective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_ranks(skip_body, 3, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    assert _first(report) == ("missing_ranks", [2], 3, "all_reduce", "world")
    where = report.issues[0].detail["missing"]["2"]
    assert where["stack"][0]["name"] == "_stuck_in_compute"  # the stuck rank's stack, from its SIGUSR1 dump
    assert where["last_entry"]["seq"] == 2
    assert report.last_completed["world"] == {"seq": 2, "op": "all_reduce", "generation": 0}
    reasons = {d.rank: d.dump_reason for d in report.dumps}
    assert reasons[0].startswith("timeout") and reasons[1].startswith("timeout") and reasons[2] == "signal SIGUSR1"
    states = {d.rank: d.entries[-1]["state"] for d in report.dumps}
    assert states == {0: "timed_out", 1: "timed_out", 2: "completed"}
    # PyTorch's own analyzer reads the pickle flavour of the same dumps and reports the same missing rank
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "missing ranks: {2}" in proc.stdout + proc.stderr
    # the CLI on the same folder: JSON report and an HTML timeline
    assert cli_main(["fr", "analyze", str(tmp_path), "--json", "--timeline", str(tmp_path / "t.html")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["issues"][0]["kind"] == "missing_ranks" and doc["issues"][0]["ranks"] == [2]
    assert "hang: all_reduce #3 on world" in (tmp_path / "t.html").read_text()


def test_op_mismatch(tmp_path: Path) -> None:
    assert run_ranks(op_mismatch_body, 3, args=(str(tmp_path),), timeout=90) == [True] * 3  # every rank auto-dumped
    assert _first(_analyze(tmp_path)) == ("op_mismatch", [1], 2, "all_reduce", "world")


@pytest.mark.parametrize("kind", ["size", "dtype"])
def test_size_and_dtype_mismatch(kind: str, tmp_path: Path) -> None:
    run_ranks(size_dtype_body, 3, args=(str(tmp_path), kind), timeout=90)
    report = _analyze(tmp_path)
    expected_op = "broadcast" if kind == "size" else "all_reduce"
    assert _first(report) == (f"{kind}_mismatch", [2], 2, expected_op, "world")
    assert len(report.issues) == 1


def test_send_without_recv(tmp_path: Path) -> None:
    run_ranks(p2p_body, 2, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    assert _first(report) == ("unmatched_p2p", [0], 1, "send", "world")
    assert report.issues[0].detail["peer"] == 1


def test_batch_p2p_pairs_each_op_by_tag(tmp_path: Path) -> None:
    """batch_p2p is recorded op by op with its peers and tags: the tag-8 send pairs with rank 1's tag-8 recv, the
    tag-7 send is reported unmatched (tag and peer named)."""
    run_ranks(tagged_batch_body, 2, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    unmatched = [i for i in report.issues if i.kind == "unmatched_p2p"]
    assert len(unmatched) == 1, report.issues
    assert unmatched[0].ranks == [0] and unmatched[0].op == "send"
    assert unmatched[0].detail["tag"] == 7 and unmatched[0].detail["peer"] == 1


def test_window_wait_signal_that_never_came(tmp_path: Path) -> None:
    """Window ops are in the dumps (one-sided: numbered with the p2p ops, never paired); a wait_signal that timed out
    is reported as window_op naming the waiting rank and the peer; collectives around it stay aligned; the
    torchfrtrace-compatible pickle dumps leave window ops out."""
    run_ranks(window_signal_body, 2, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    found = [(i.kind, i.ranks, i.op) for i in report.issues]
    assert found[0] == ("window_op", [1], "window.wait_signal"), report.issues
    # the only other finding is the consequence: rank 1 reached the next all_reduce ~1 s late
    assert found[1:] in ([], [("straggler", [1], "all_reduce")]), report.issues
    issue = report.issues[0]
    assert issue.detail["peer"] == 0 and issue.detail["state"] == "timed_out"
    assert "waits for a signal from rank 0" in issue.message
    dump = json.loads(next(tmp_path.glob("*rank_1.json")).read_text())
    ops = [e["op"] for e in dump["entries"]]
    assert "window.put" in ops and "window.wait_signal" in ops
    import pickle

    with open(next(p for p in tmp_path.iterdir() if p.name.endswith("rank_1") and "trace" in p.name), "rb") as f:
        compat = pickle.load(f)
    assert not [e for e in compat["entries"] if e["profiling_name"].split(":")[-1].startswith("window.")]


def test_straggler(tmp_path: Path) -> None:
    run_ranks(straggler_body, 3, args=(str(tmp_path),), timeout=90)
    report = analyze_dir(tmp_path, straggler_ms=1000)  # 1.5 s scripted; a loaded CI box may add a few 100 ms
    assert _first(report) == ("straggler", [1], 3, "all_reduce", "world")
    assert report.issues[0].detail["late_ms"] > 1000
    assert len(report.issues) == 1 and report.last_completed["world"]["seq"] == 4


def test_killed_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ranks(killed_body, 3, args=(str(tmp_path),), timeout=90, allow_exit={2})
    assert all(out[r] for r in (0, 1))  # survivors dumped automatically on the failure
    report = _analyze(tmp_path)
    assert _first(report) == ("missing_ranks", [2], 3, "all_reduce", "world")
    assert report.ranks_without_dump == [2] and report.issues[0].detail["no_dump"] == [2]
    assert all(d.dump_reason.split(":")[0] in ("peer_failure", "timeout", "error") for d in report.dumps)
    # the text report prints real backend errors (full of "[...]") verbatim
    assert cli_main(["fr", "analyze", str(tmp_path), "--fail-on-issues"]) == 1
    out = capsys.readouterr().out
    assert "missing_ranks" in out and "left no dump" in out


def test_abort_dumps_in_flight_ops(tmp_path: Path) -> None:
    out = run_ranks(abort_body, 2, args=(str(tmp_path),), timeout=90)
    reason, dumped_states, final_states = out[0]
    assert reason.startswith("abort") and "operator gave up" in reason
    assert dumped_states == ["completed", "started"]  # dumped before the in-flight op was cancelled
    assert final_states == ["completed", "aborted"]


def test_split_children_recorded_with_their_own_pg(tmp_path: Path) -> None:
    names = run_ranks(split_body, 4, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    child = names[2]
    assert report.groups[child].ranks == [2, 3] and report.groups[names[0]].ranks == [0, 1]
    assert report.groups["world"].ranks == [0, 1, 2, 3]
    assert _first(report) == ("missing_ranks", [3], 2, "all_reduce", child)
    assert len(report.issues) == 1
    assert report.last_completed["world"] == {"seq": 3, "op": "all_reduce", "generation": 0}
    assert report.last_completed[names[0]] == {"seq": 2, "op": "all_reduce", "generation": 0}
    ops = [e["op"] for e in next(d for d in report.dumps if d.rank == 0).entries if e["pg"] == "world"]
    assert ops == ["all_reduce", "split", "all_reduce"]


def test_ring_wrap_and_capacity_zero(tmp_path: Path) -> None:
    assert run_ranks(wrap_body, 2, args=(str(tmp_path),), timeout=90) == [True, True]
    report = _analyze(tmp_path)
    assert report.issues == [] and report.last_completed["world"]["seq"] == 20
    assert [d.dropped for d in report.dumps] == [12, 12] and [len(d.entries) for d in report.dumps] == [8, 8]


def test_generations_stitched(tmp_path: Path) -> None:
    run_ranks(generations_body, 3, args=(str(tmp_path),), timeout=90)
    report = _analyze(tmp_path)
    assert [(i.kind, i.pg, i.generation, i.ranks, i.seq) for i in report.issues] == [
        ("missing_ranks", "world_g1@g1", 1, [1], 2)
    ]
    assert report.last_completed["world"] == {"seq": 2, "op": "all_reduce", "generation": 0}
    assert report.last_completed["world_g1@g1"] == {"seq": 1, "op": "all_reduce", "generation": 1}
