"""Which local address reaches a store: the interface a rank's listening sockets bind to."""

from __future__ import annotations

import socket
from typing import Any

import torch.distributed as dist

__all__ = ["store_route_address"]


def store_route_address(store: dist.Store) -> str | None:
    """The local address the kernel routes to the store's host from (a UDP ``connect`` sends no packet); None when
    the store has no host (a ``FileStore``, a ``HashStore``) or no route.

    Ranks that reach the store through an interface bind there: the job's network, never a guess from the hostname
    (which, inside a network namespace or on a multi-homed machine, resolves to an address other ranks cannot
    reach)."""
    s: Any = store
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    target = getattr(s, "host", None)
    if not target:
        return None
    family = socket.AF_INET6 if ":" in str(target) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(target), int(getattr(s, "port", 9)) or 9))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
