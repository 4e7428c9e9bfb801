"""How ranks register a window with each other: metadata exchange, transport choice, channels."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchnext.comms.window._host import default_host, host_key
from torchnext.comms.window.channel import WindowTransport
from torchnext.comms.window.segment import DTYPES, Segment
from torchnext.comms.window.shm import ShmChannel
from torchnext.comms.window.tcp import TcpChannel

if TYPE_CHECKING:
    from torchnext.comms.window.window import Window

__all__ = ["connect"]


def connect(win: Window, store: dist.Store, store_timeout: timedelta, tensor: torch.Tensor, code: int,
            mode: WindowTransport | None, host: str | None, status_errors: dict[int, type[Exception]]) -> None:
    """The registration handshake of ``Window.__init__`` (collective): publish this rank's registration, read
    everyone's, choose each pair's transport, start this rank's TCP service if a peer needs it, connect a channel to
    every target, then a barrier after which the segment file and the store keys are removed.

    Fills ``win.numels``, ``win.shapes``, ``win.dtypes`` and the window's ``_kinds``, ``_service`` and ``_channels``
    as it goes, so that ``Window._release`` can undo a handshake that failed half way.
    """
    comm, rank, size = win._comm, win.rank, win.size
    # The window token: rank 0's random bytes, broadcast over the communicator -- never a store value (the store
    # has no authentication: whoever reaches it could read the token there).
    token_t = torch.zeros(32, dtype=torch.uint8, device=comm.device)
    if rank == 0:
        token_t.copy_(torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8))
    comm.broadcast(token_t, 0)
    token = bytes(token_t.cpu().numpy().tobytes())
    mine = {"numel": tensor.numel(), "shape": list(tensor.shape), "dtype": code, "pid": os.getpid(),
            "host": host_key(), "path": win._segment.path, "mode": None if mode is None else mode.value}
    store.set(f"meta/{rank}", json.dumps(mine))
    store.wait([f"meta/{r}" for r in range(size)], store_timeout)
    metas = [json.loads(store.get(f"meta/{r}")) for r in range(size)]
    if len({m["mode"] for m in metas}) != 1:
        raise ValueError(f"new_window: ranks passed different transports: {[m['mode'] for m in metas]}")
    win.numels = [int(m["numel"]) for m in metas]
    win.shapes = [tuple(int(s) for s in m["shape"]) for m in metas]
    win.dtypes = [DTYPES[int(m["dtype"])] for m in metas]
    hosts = [m["host"] for m in metas]
    if mode is WindowTransport.SHM and len(set(hosts)) != 1:
        raise ValueError("new_window: transport='shm' needs every rank on one host; ranks are on several")

    def kind(a: int, b: int) -> WindowTransport:
        tcp = mode is WindowTransport.TCP or hosts[a] != hosts[b]
        return WindowTransport.TCP if tcp else WindowTransport.SHM

    win._kinds = [kind(rank, r) for r in range(size)]
    serves = any(kind(r, rank) is WindowTransport.TCP for r in range(size))
    if serves:
        from torchnext.comms.window.tcp import TcpService

        bind = host or default_host(comm.store)
        win._service = TcpService(win._segment, token, bind, tuple(tensor.shape), size)
        store.set(f"tcp/{rank}", json.dumps(list(win._service.address)))
    tcp_peers = [r for r in range(size) if win._kinds[r] is WindowTransport.TCP]
    if tcp_peers:
        store.wait([f"tcp/{r}" for r in tcp_peers], store_timeout)
    for r in range(size):
        if win._kinds[r] is WindowTransport.SHM:
            seg = win._segment if r == rank else Segment.attach(metas[r]["path"], win.numels[r],
                                                                 win.dtypes[r], size)
            win._channels[r] = ShmChannel(r, rank, seg, int(metas[r]["pid"]), win._ctx)
        else:
            addr = tuple(json.loads(store.get(f"tcp/{r}")))
            win._channels[r] = TcpChannel(r, rank, (str(addr[0]), int(addr[1])), token, win._timeout_s,
                                           win._ctx, status_errors)
    comm.barrier()  # every peer has mapped/connected: the segment name and the store keys can go
    win._segment.unlink()
    mine_keys = [f"meta/{rank}", *([f"tcp/{rank}"] if serves else [])]
    for key in mine_keys:
        with contextlib.suppress(Exception):  # stores without delete_key keep them (harmless)
            store.delete_key(key)
