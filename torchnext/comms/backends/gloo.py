"""Gloo backend (CPU tensors): ``torch.distributed.ProcessGroupGloo``.

Measured on torch 2.13.0: the constructor connects the full mesh (eager); every collective supports SUM, AVG
(floating), PRODUCT, MIN, MAX on float32/bfloat16/int64; collective Works carry a future whose callback fires on a
Gloo worker thread; send/recv Works have no future and their ``wait(timeout)`` fails the op when ``timeout`` elapses (a
collective Work's only stops waiting); the list-form alltoall needs equal chunk sizes; ``abort()`` does nothing, so the Communicator abandons the backend
instead (see ``Communicator.abort``) and cancels its ops by shutting down the device's pair sockets
(:mod:`.gloo_sockets`), so that :mod:`torchnext.comms.reaper` can release it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchnext.comms._address import store_route_address
from torchnext.comms.backends import BackendConfig, BackendHandle
from torchnext.comms.backends.gloo_sockets import cancel_sockets, create_watched_device

__all__ = ["create"]


def _options(cfg: BackendConfig) -> tuple[Any, list[tuple[int, int]] | None]:
    """Gloo options whose device binds to the interface that reaches the store (``GLOO_SOCKET_IFNAME``, torch's
    own knob, wins when set). torch's default device binds to whatever the hostname resolves to -- inside a network
    namespace or on a multi-homed host that is an address the other ranks cannot reach (or loopback). Also returns
    the devices' epoll instances (:mod:`.gloo_sockets`), or None when one of them could not be told."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch exposes it, the stubs do not
    opts._timeout = cfg.timeout
    ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    pgg = dist.ProcessGroupGloo
    makers: list[Callable[[], Any]]
    if ifnames:
        makers = [functools.partial(pgg.create_device, interface=i) for i in ifnames]
    else:
        addr = store_route_address(cfg.store)
        makers = [functools.partial(pgg.create_device, hostname=addr) if addr else pgg.create_default_device]
    devices, epolls = [], []
    for make in makers:
        device, epoll = create_watched_device(make)
        devices.append(device)
        epolls.append(epoll)
    opts._devices = devices
    return opts, (None if None in epolls else [e for e in epolls if e is not None])


def create(cfg: BackendConfig) -> BackendHandle:
    """Connect a ``ProcessGroupGloo`` over ``cfg.store`` (blocks until every member joined or ``cfg.timeout``)."""
    device = torch.device("cpu") if cfg.device is None else torch.device(cfg.device)
    if device.type != "cpu":
        raise ValueError(f"the gloo backend communicates CPU tensors; got device={device}")
    if not dist.is_gloo_available():
        raise RuntimeError("this torch build has no Gloo support (torch.distributed.is_gloo_available() is False)")
    opts, epolls = _options(cfg)
    pg = dist.ProcessGroupGloo(cfg.store, cfg.rank, cfg.size, opts)
    return BackendHandle(pg=pg, device=device, native_avg=True, interruptible_wait=True,
                         futureless_ops=frozenset({"reduce_scatter", "reduce_scatter_single"}),
                         cancel_fn=None if epolls is None else _canceller(epolls))


def _canceller(epolls: list[tuple[int, int]]) -> Callable[[], int]:
    def cancel() -> int:
        return sum(cancel_sockets(e) for e in epolls)

    return cancel
