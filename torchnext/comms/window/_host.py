"""Where a rank is: its shared-memory domain, and the local address its TCP window service binds to."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from torchnext.comms._address import store_route_address

__all__ = ["default_host", "host_key"]


def host_key() -> str:
    """Identifies a shared-memory domain: hostname, boot id, and the IPC/PID namespaces."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    for ns in ("/proc/self/ns/pid", "/proc/self/ns/ipc", "/proc/self/ns/mnt"):
        try:
            parts.append(str(os.stat(ns).st_ino))
        except OSError:
            pass
    return "|".join(parts)


def default_host(store: dist.Store) -> str:
    """The local address used to reach the store's host (no packet is sent); 127.0.0.1 when unknown."""
    return store_route_address(store) or "127.0.0.1"
