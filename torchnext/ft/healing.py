"""Healing: stream a member's state (model + optimizer ``state_dict``, step counter) to joiners, checksummed.

Transport is the new generation's :class:`~torchnext.comms.Communicator` (torch.distributed send/recv, or broadcast
when every member but the donor is a joiner, as at formation). No pickle: the state's structure travels as JSON
(dicts, lists, tuples, str/int/float/bool/None) with tensors replaced by ``{"__t": i}``; tensors travel as raw bytes.

Wire order (donor -> joiner)::

    meta   int64[4]   = [MAGIC, len(header), n_tensors, chunk_bytes]
    header uint8[len] = JSON {"v": 1, "step": step, "skeleton": ..., "specs": [[dtype, shape, path], ...]}
    for each tensor, for each chunk of its bytes: the chunk (a view: no copy on either side)
    crcs   int64[n_tensors] = zlib.crc32 of each tensor's bytes (computed while the chunks are in flight)

Memory: the donor sends views of its tensors (a non-contiguous tensor is made contiguous, one at a time). The
joiner receives **in place** into its own tensors wherever ``into`` (its current state) has a tensor of the same
path, dtype and shape; only missing ones (e.g. optimizer moments of a fresh optimizer) are allocated. The joiner
checks every checksum before it returns the state; a mismatch raises :class:`HealingError` and nothing is loaded.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CommError
from torchnext.comms.work import Work

__all__ = ["HealStats", "HealingError", "flatten_state", "recv_state", "send_state", "unflatten_state"]

MAGIC = 0x7E4EA1
DEFAULT_CHUNK_BYTES = 4 << 20
_WINDOW = 4  # chunks in flight per side


class HealingError(CommError):
    """State transfer failed verification (checksum, structure) -- retryable: the group reconfigures and heals again."""


@dataclass(frozen=True)
class HealStats:
    """What one transfer moved."""

    bytes: int
    seconds: float
    tensors: int
    chunks: int

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------------------- structure <-> JSON
def flatten_state(obj: Any) -> tuple[Any, list[torch.Tensor], list[str]]:
    """``obj`` -> (JSON-able skeleton, tensors, their paths). Reference: ``unflatten_state(skel, ts) == obj``."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            paths.append(path)
            return {"__t": len(tensors) - 1}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state at {path or '/'}: dict key {k!r} has type {type(k).__name__}; "
                                    "healing supports str and int keys")
                items.append([k, enc(v, f"{path}/{k}")])
            return {"__d": items}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tu": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"state at {path or '/'} has type {type(x).__name__}; healing transfers tensors and "
                        "JSON-like values (dict, list, tuple, str, int, float, bool, None) only")

    return enc(obj, ""), tensors, paths


def unflatten_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__t" in skeleton:
            return tensors[skeleton["__t"]]
        if "__tu" in skeleton:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tu"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton["__d"]}
    return skeleton


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise HealingError(f"healing header names an unknown dtype {name!r}")
    return dt


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous CPU tensor's bytes."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------------- transfer
def _link(comm: Communicator, peer: int | None, root: int) -> Callable[[torch.Tensor, bool], Work | None]:
    """One way of moving a tensor from ``root``: send/recv with ``peer``, or broadcast (``peer=None``)."""
    if peer is None:
        return lambda t, async_op: comm.broadcast(t, root, async_op=async_op)
    if comm.rank == root:
        return lambda t, async_op: comm.send(t, peer, async_op=async_op)
    return lambda t, async_op: comm.recv(t, peer, async_op=async_op)


def send_state(
    comm: Communicator,
    state: Any,
    *,
    step: int,
    dst: int | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> HealStats:
    """Stream ``state`` to rank ``dst`` (or to every other rank by broadcast when ``dst`` is None)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    t0 = time.perf_counter()
    skeleton, tensors, paths = flatten_state(state)
    for p, t in zip(paths, tensors, strict=True):
        if t.device.type != "cpu":
            raise ValueError(f"healing: tensor at {p} is on {t.device}; move state to CPU (Gloo) first")
    specs = [[str(t.dtype), list(t.shape), p] for t, p in zip(tensors, paths, strict=True)]
    header = json.dumps({"v": 1, "step": step, "skeleton": skeleton, "specs": specs}).encode()
    move = _link(comm, dst, comm.rank)
    move(torch.tensor([MAGIC, len(header), len(tensors), chunk_bytes], dtype=torch.int64), False)
    move(torch.frombuffer(bytearray(header), dtype=torch.uint8), False)
    pending: deque[Work] = deque()
    crcs: list[int] = []
    total = chunks = 0
    for t in tensors:
        data = _byte_view(t if t.is_contiguous() else t.contiguous())
        crc = 0
        for off in range(0, data.numel(), chunk_bytes):
            piece = data[off: off + chunk_bytes]
            work = move(piece, True)
            assert work is not None
            pending.append(work)
            crc = zlib.crc32(piece.numpy().data, crc)  # releases the GIL; overlaps with the transfer
            chunks += 1
            while len(pending) > _WINDOW:
                pending.popleft().wait()
        total += data.numel()
        crcs.append(crc)
    while pending:
        pending.popleft().wait()
    move(torch.tensor([*crcs, MAGIC], dtype=torch.int64), False)  # +1: never an empty tensor
    return HealStats(total, time.perf_counter() - t0, len(tensors), chunks)


def recv_state(
    comm: Communicator,
    *,
    src: int,
    broadcast: bool,
    into: Any = None,
) -> tuple[Any, int, HealStats]:
    """Receive what :func:`send_state` streams from rank ``src``: returns ``(state, step, stats)``, verified.

    ``into``: this process's current state (same structure as the donor's, e.g. ``model.state_dict()``); tensors
    of matching path, dtype and shape are received in place (no extra copy). A checksum mismatch or malformed
    header raises :class:`HealingError` (nothing of the partial state should be used).
    """
    t0 = time.perf_counter()
    move = _link(comm, None if broadcast else src, src)
    meta = torch.zeros(4, dtype=torch.int64)
    move(meta, False)
    magic, hlen, n, chunk_bytes = (int(x) for x in meta.tolist())
    if magic != MAGIC or hlen <= 0 or n < 0 or chunk_bytes <= 0:
        raise HealingError(f"healing: bad stream header {meta.tolist()} from rank {src}")
    hbuf = torch.empty(hlen, dtype=torch.uint8)
    move(hbuf, False)
    try:
        header = json.loads(hbuf.numpy().tobytes())
        specs = header["specs"]
        step = int(header["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise HealingError(f"healing: unreadable header from rank {src}: {exc}") from exc
    if len(specs) != n:
        raise HealingError(f"healing: header lists {len(specs)} tensors, meta says {n}")
    local: dict[str, torch.Tensor] = {}
    if into is not None:
        _, ts, ps = flatten_state(into)
        local = dict(zip(ps, ts, strict=True))
    tensors: list[torch.Tensor] = []
    for dtype_name, shape, path in specs:
        dt = _dtype(dtype_name)
        mine = local.get(path)
        if (mine is not None and mine.dtype == dt and list(mine.shape) == list(shape) and mine.is_contiguous()
                and mine.device.type == "cpu"):
            tensors.append(mine)
        else:
            tensors.append(torch.empty(shape, dtype=dt))
    pending: deque[tuple[int, torch.Tensor, Work]] = deque()
    crcs = [0] * n
    total = chunks = 0

    def settle_one() -> None:
        i, piece, work = pending.popleft()
        work.wait()
        crcs[i] = zlib.crc32(piece.numpy().data, crcs[i])

    for i, t in enumerate(tensors):
        data = _byte_view(t)
        for off in range(0, data.numel(), chunk_bytes):
            piece = data[off: off + chunk_bytes]
            work = move(piece, True)
            assert work is not None
            pending.append((i, piece, work))
            chunks += 1
            while len(pending) > _WINDOW:
                settle_one()
        total += data.numel()
    while pending:
        settle_one()
    remote = torch.zeros(n + 1, dtype=torch.int64)
    move(remote, False)
    if int(remote[n]) != MAGIC:
        raise HealingError(f"healing: bad checksum trailer from rank {src}")
    for i, (want, got) in enumerate(zip(remote[:n].tolist(), crcs, strict=True)):
        if want != got:
            raise HealingError(f"healing: checksum mismatch for tensor {specs[i][2] or i!r} "
                               f"(crc32 {got:#010x}, donor sent {want:#010x})")
    state = unflatten_state(header["skeleton"], tensors)
    return state, step, HealStats(total, time.perf_counter() - t0, n, chunks)
