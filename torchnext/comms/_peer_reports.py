"""Peer-failure reports through the communicator's store.

Gloo tells a peer's death only to the ranks that talk to it in the failing op; the others would sit in the op until
its timeout and see a plain CommTimeout. So the first rank that sees a PeerFailure publishes it under
:data:`PEER_FAILURE_KEY` in the communicator's store namespace, and a rank whose op times out looks there: a
published report turns its timeout into a PeerFailure naming the reporter. Both happen only on failure paths, off
the hot path, and both are bounded (a store that does not answer within ``within_s`` is left behind in a daemon
thread)::

    publish(store, msg, name)   # store.set(PEER_FAILURE_KEY, msg), at most within_s
    reported(store, name)       # store.get(PEER_FAILURE_KEY) if it exists, else None; at most within_s
"""

from __future__ import annotations

import threading

import torch.distributed as dist

__all__ = ["PEER_FAILURE_KEY", "publish", "reported"]

PEER_FAILURE_KEY = "peer_failure"
"""Store key (in the communicator's namespace) where the first rank that saw a PeerFailure publishes it."""


def publish(store: dist.Store, msg: str, name: str, within_s: float = 1.0) -> None:
    """Record ``msg`` for the other members before the failing op returns to its caller (whose next store request,
    e.g. building a new communicator, would otherwise queue ahead of it on a TCPStore client)."""

    def run() -> None:
        try:
            store.set(PEER_FAILURE_KEY, msg)
        except Exception:  # the store may be gone too; the report is best effort
            pass

    t = threading.Thread(target=run, name=f"torchnext-{name}-report", daemon=True)
    t.start()
    t.join(within_s)


def reported(store: dist.Store, name: str, within_s: float = 1.0) -> str | None:
    """The failure another member published, if any."""
    box: list[str] = []

    def ask() -> None:
        try:
            if store.check([PEER_FAILURE_KEY]):
                box.append(store.get(PEER_FAILURE_KEY).decode(errors="replace"))
        except Exception:
            pass

    t = threading.Thread(target=ask, name=f"torchnext-{name}-ask", daemon=True)
    t.start()
    t.join(within_s)
    return box[0] if box else None
