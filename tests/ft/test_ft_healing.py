"""Healing transfers (ranks as threads over Gloo): exact round trip, in-place reception, broadcast, corruption."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import Communicator
from torchnext.ft import HealingError
from torchnext.ft.healing import flatten_state, recv_state, send_state, unflatten_state
from torchnext.testing import RankContext, RankFailure, run_threads


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300_001, generator=g)  # several chunks with chunk_bytes=256 KiB, last one partial
    return {
        "model": {"w": big, "b16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
                  "steps": torch.tensor(seed, dtype=torch.int64), "mask": torch.rand(9, generator=g) > 0.5,
                  "t": torch.randn(4, 6, generator=g).t(), "empty": torch.zeros(0, 3)},
        "optim": {"state": {0: {"m": torch.randn(3, generator=g)}, 1: {}},
                  "param_groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.99), "params": [0, 1], "name": None}]},
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b  # type: ignore[no-any-return]


def test_flatten_roundtrip_and_rejects_unknown_types() -> None:
    s = _state(1)
    skel, ts, paths = flatten_state(s)
    assert _equal(unflatten_state(skel, ts), s)
    assert "/model/w" in paths and "/optim/state/0/m" in paths
    with pytest.raises(TypeError, match="/x/f"):
        flatten_state({"x": {"f": object()}})
    with pytest.raises(TypeError, match="dict key"):
        flatten_state({(1, 2): 3})


def _p2p(ctx: RankContext) -> Any:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="heal")
    if ctx.rank == 0:
        stats = send_state(comm, _state(3), step=17, dst=1, chunk_bytes=256 << 10)
        return stats.bytes
    into = _state(4)  # same structure, different values: received in place where shapes match
    ptr = into["model"]["w"].data_ptr()
    state, step, stats = recv_state(comm, src=0, broadcast=False, into=into)
    return _equal(state, _state(3)), step, state["model"]["w"].data_ptr() == ptr, stats.bytes, stats.chunks


def test_p2p_transfer_exact_in_place_and_checksummed() -> None:
    sent, (equal, step, in_place, got, chunks) = run_threads(_p2p, 2, timeout=60)
    assert equal and step == 17 and in_place
    assert got == sent and chunks > 4


def _bcast(ctx: RankContext) -> Any:
    comm = Communicator(ctx.store, ctx.rank, 3, timeout=timedelta(seconds=30), name="heal_b")
    if ctx.rank == 1:
        send_state(comm, _state(5), step=2, dst=None, chunk_bytes=1 << 20)
        return True
    state, step, _ = recv_state(comm, src=1, broadcast=True)
    return _equal(state, _state(5)) and step == 2


def test_broadcast_transfer_to_every_joiner() -> None:
    assert run_threads(_bcast, 3, timeout=60) == [True, True, True]


class _Corrupting:
    """A Communicator stand-in whose recv flips one byte of the first large chunk after it arrives."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.done = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def recv(self, t: torch.Tensor, src: int, async_op: bool = False) -> Any:
        work = self.comm.recv(t, src, async_op=async_op)
        if self.done or t.numel() < 1000:
            return work
        self.done = True

        class _W:
            def wait(self) -> bool:
                ok = work.wait() if work is not None else True
                t[10] ^= 0x40
                return bool(ok)

        if async_op:
            return _W()
        t[10] ^= 0x40
        return None


def _corrupt(ctx: RankContext) -> Any:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="heal_c")
    if ctx.rank == 0:
        send_state(comm, _state(6), step=1, dst=1, chunk_bytes=64 << 10)
        return None
    recv_state(_Corrupting(comm), src=0, broadcast=False)  # type: ignore[arg-type]
    return None


def test_corrupted_chunk_is_detected_before_use() -> None:
    with pytest.raises(RankFailure, match="checksum mismatch for tensor '/model/w'"):
        run_threads(_corrupt, 2, timeout=60)


def test_healing_error_is_a_comm_error() -> None:
    from torchnext.comms import CommError

    assert issubclass(HealingError, CommError)
