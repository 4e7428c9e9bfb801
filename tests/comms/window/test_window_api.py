"""Window argument checking: bounds and dtype errors raised on the caller before any byte moves (client side and,
for TCP, again on the target's service), wait_signal timeout, bad registrations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import (
    CommTimeout,
    Communicator,
    ReduceOp,
    WindowBoundsError,
    WindowDtypeError,
)
from torchnext.testing import RankContext, run_ranks


def _bad_inputs(ctx: RankContext, transport: str) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="bad")
    peer = 1 - ctx.rank
    init = torch.arange(12.0).view(3, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        comm.new_window(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="cannot register dtype"):
        comm.new_window(torch.ones(4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="not a valid WindowTransport"):
        comm.new_window(torch.ones(4), transport="rdma")
    win = comm.new_window(init, transport=transport)
    flat1 = comm.new_window(torch.ones(5), transport=transport)
    cases: list[tuple[type[Exception], str, Any]] = [
        (WindowBoundsError, r"elements \[10, 13\) are outside rank \d's registered tensor of 12", lambda: win.put(torch.ones(3), peer, 10)),
        (WindowBoundsError, r"\[-1, 0\)", lambda: win.put(torch.ones(1), peer, -1)),
        (WindowBoundsError, r"\[5, 13\)", lambda: win.get(peer, 5, 8)),
        (WindowBoundsError, r"\[0, 13\)", lambda: win.accumulate(torch.ones(13), peer, 0)),
        (WindowBoundsError, r"row index 3 outside rank \d's rows \[0, 3\)", lambda: win.get_rows(peer, [0, 3])),
        (WindowBoundsError, r"row index -1", lambda: win.get_rows(peer, torch.tensor([-1, 1]))),
        (WindowDtypeError, "src dtype torch.float64 does not match", lambda: win.put(torch.ones(2, dtype=torch.float64), peer, 0)),
        (WindowDtypeError, "src dtype torch.int64", lambda: win.accumulate(torch.ones(2, dtype=torch.int64), peer, 0)),
        (WindowDtypeError, "out dtype torch.int32", lambda: win.get(peer, 0, 2, out=torch.empty(2, dtype=torch.int32))),
        (ValueError, "out has shape", lambda: win.get(peer, 0, 2, out=torch.empty(3))),
        (ValueError, "out has shape", lambda: win.get_rows(peer, [0], out=torch.empty(2, 2))),
        (ValueError, "contiguous", lambda: win.get(peer, 0, 4, out=torch.empty(2, 2).t())),
        (TypeError, "indices must be a 1-D integer tensor", lambda: win.get_rows(peer, torch.tensor([0.5]))),
        (TypeError, "indices must be a 1-D integer tensor", lambda: win.get_rows(peer, torch.zeros(1, 1, dtype=torch.int64))),
        (ValueError, "not a 2-D tensor", lambda: flat1.get_rows(peer, [0])),
        (ValueError, "dst_rank=2 is out of range", lambda: win.put(torch.ones(1), 2, 0)),
        (TypeError, "src_rank must be an int", lambda: win.get("0")),  # type: ignore[arg-type]
        (TypeError, "offset and numel must be ints", lambda: win.get(peer, 0.5, 1)),  # type: ignore[arg-type]
        (ValueError, "op AVG is not supported", lambda: win.accumulate(torch.ones(1), peer, 0, ReduceOp.AVG)),
        (ValueError, "unknown reduce op", lambda: win.accumulate(torch.ones(1), peer, 0, "mean")),
        (ValueError, "value must be a positive int", lambda: win.signal(peer, 0)),
        (TypeError, "src must be a torch.Tensor", lambda: win.put([1.0], peer, 0)),  # type: ignore[arg-type]
    ]
    for exc_type, pattern, call in cases:
        with pytest.raises(exc_type, match=pattern):
            call()
    assert issubclass(WindowBoundsError, IndexError) and issubclass(WindowDtypeError, TypeError)
    out: dict[str, Any] = {}
    if transport == "tcp":
        # bypass the window's checks: the target's service re-checks and writes nothing
        ch: Any = win._channels[peer]
        with pytest.raises(WindowBoundsError, match="outside the target's"):
            ch.put(10, torch.ones(4))
        with pytest.raises(WindowDtypeError, match="does not match the target's registered dtype"):
            ch.put(0, torch.ones(2, dtype=torch.float64))
        with pytest.raises(WindowBoundsError, match="row index outside"):
            ch.get_rows(torch.tensor([7]), torch.empty(1, 4))
        win.put(torch.tensor([-5.0]), peer, 11)  # the connection still works after rejected requests
    t0 = __import__("time").perf_counter()
    with pytest.raises(CommTimeout, match="signal count from rank"):
        win.wait_signal(peer, 1, timeout=0.2)
    out["timeout_s"] = __import__("time").perf_counter() - t0
    win.fence()
    out["mine"] = win.tensor.view(-1).tolist()
    flat1.close()
    win.close()
    comm.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bad_accesses_raise_before_any_byte_moves(transport: str) -> None:
    for res in run_ranks(_bad_inputs, 2, args=(transport,), timeout=90):
        expected = list(range(11)) + ([-5.0] if transport == "tcp" else [11.0])
        assert res["mine"] == expected
        assert 0.15 < res["timeout_s"] < 3.0
