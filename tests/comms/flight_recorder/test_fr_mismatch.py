"""Without the consistency mode: real mismatches on 3 and 4 Gloo ranks, and the analyzer naming the culprit from the
dumps that survive (Gloo may terminate a correct rank: it then leaves no dump).

Every rank is a process of ``torchnext.testing.run_ranks``; the op that goes wrong gets a short per-op timeout
(``FAULT_S``), everything else a generous one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchnext.comms import CommError, Communicator, FlightRecorder
from torchnext.comms.flight_recorder import analyze_dir
from torchnext.testing import RankContext, RankExited, run_ranks

FAULT_S = 2.0
FORMATS = ("json", "pickle")


def _dump(fr: FlightRecorder, d: str) -> None:
    for fmt in FORMATS:
        fr.dump(d + os.sep, format=fmt, reason="end of test")


def _wait_count(ctx: RankContext, key: str, n: int, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while ctx.store.add(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def mismatch_body(ctx: RankContext, d: str, kind: str, culprit: int) -> Any:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=60), name="world")
    fr = FlightRecorder.attach(comm, dump_dir=d, auto_dump_formats=FORMATS)
    me = ctx.rank == culprit
    t = torch.ones(4)
    comm.all_reduce(t)
    others = ctx.world_size - 1
    try:
        if kind == "size":  # the issue's case: Gloo terminates a correct rank (the one receiving 6 elements)
            n = 6 if me else 4
            comm.all_gather_single(torch.empty(n * ctx.world_size), torch.ones(n), timeout=FAULT_S)
        elif kind == "dtype":  # same byte size: Gloo reduces garbage silently
            comm.all_reduce(torch.ones(4, dtype=torch.int32 if me else torch.float32), timeout=FAULT_S)
        elif kind == "op":
            if me:
                comm.broadcast(t, 0, timeout=FAULT_S)
            else:
                comm.all_reduce(t, timeout=FAULT_S)
        elif kind == "root":
            comm.broadcast(t, 1 if me else 0, timeout=FAULT_S)
        elif kind == "skip":  # the culprit skips an all_reduce: its barrier meets the others' all_reduce
            if not me:
                comm.all_reduce(t, timeout=FAULT_S)
            comm.barrier(timeout=FAULT_S)
        elif kind == "extra":  # the culprit issues one all_reduce more; the others go on to a barrier
            if me:
                comm.all_reduce(t, timeout=FAULT_S)
            comm.barrier(timeout=FAULT_S)
        elif kind == "skip_last":  # the culprit skips the last all_reduce and dumps after the others gave up
            if me:
                _wait_count(ctx, "done", others)
            else:
                comm.all_reduce(t, timeout=FAULT_S)
        elif kind == "extra_last":  # the culprit issues one last all_reduce nobody else issues
            if me:
                comm.all_reduce(t, timeout=FAULT_S)
            else:
                _wait_count(ctx, "entered", 1)
        if not kind.endswith("_last"):
            comm.all_reduce(t, timeout=FAULT_S)
    except CommError:
        pass
    if me and kind == "extra_last":
        ctx.store.add("entered", 1)
    if not me:
        ctx.store.add("done", 1)
    _dump(fr, d)
    return "dumped"


# kind -> the first issue's kind; ranks the analyzer must name first
EXPECTED = {
    "size": "size_mismatch",
    "dtype": "dtype_mismatch",
    "op": "op_mismatch",
    "root": "root_mismatch",
    "skip": "op_mismatch",
    "extra": "op_mismatch",
    "skip_last": "missing_ranks",
    "extra_last": "extra_collective",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
@pytest.mark.parametrize("world,culprit", [(3, 1), (4, 3)])
def test_analyzer_names_the_culprit_from_the_surviving_dumps(tmp_path: Path, kind: str, world: int,
                                                             culprit: int) -> None:
    d = str(tmp_path)
    results = run_ranks(mismatch_body, world, args=(d, kind, culprit), timeout=180, allow_exit=range(world))
    dead = [r for r, res in enumerate(results) if isinstance(res, RankExited)]
    if kind != "size":
        assert not dead, results
    report = analyze_dir(tmp_path)
    assert sorted(report.ranks_without_dump) == dead
    first = report.issues[0]
    assert first.kind == EXPECTED[kind], [i.message for i in report.issues]
    assert first.ranks == [culprit], [i.message for i in report.issues]
    if kind == "size":
        assert dead and culprit not in dead  # Gloo killed a correct rank (SIGABRT): the victim, not the culprit
        assert all(r.exitcode == -6 for r in results if isinstance(r, RankExited))
        assert first.seq == 2 and first.op == "all_gather_single"
        assert f"rank {culprit} entered all_gather_single #2 on 'world' with input [6], output [{6 * world}]" \
            in first.message, first.message
        assert "reported input [4]" in first.message
        assert f"left no dump ({'probably terminated' if dead else ''}" in first.message
        follow = [i for i in report.issues[1:] if i.kind == "missing_ranks"]
        assert follow and follow[0].ranks == dead and "consequence of the size mismatch" in follow[0].message


def test_the_issue_case_in_the_cli_and_in_torchfrtrace(tmp_path: Path) -> None:
    """The case of issue 19 (3 ranks, rank 1 all_gathers 6 elements where ranks 0 and 2 use 4), through the CLI,
    and what PyTorch's own analyzer says about the same dumps (recorded in docs/flight_recorder.md)."""
    d = str(tmp_path)
    results = run_ranks(mismatch_body, 3, args=(d, "size", 1), timeout=180, allow_exit=range(3))
    assert isinstance(results[2], RankExited)
    env = {**os.environ, "COLUMNS": "200"}
    ours = subprocess.run([sys.executable, "-m", "torchnext", "fr", "analyze", d, "--allow-pickle"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert ours.returncode == 0, ours.stderr
    text = " ".join(ours.stdout.split())
    assert "1. size_mismatch rank 1 entered all_gather_single #2 on 'world' with input [6], output [18] where " \
           "rank 0 reported input [4], output [12]" in text, ours.stdout
    assert "rank 2 left no dump" in text
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", d,
                             "--allow-incomplete-ranks"], capture_output=True, text=True, timeout=120, env=env)
    # torchfrtrace (torch 2.13) reads the same pickles: it sees the two sizes, takes the first record (rank 1's) as
    # the expectation and names rank 0 -- what docs/flight_recorder.md records
    said = theirs.stdout + theirs.stderr
    assert "Traceback" not in said, said
    assert "SIZE_OR_SYNTAX_MISMATCH" in said and "missed FR dumps from ranks ({2})" in said, said
