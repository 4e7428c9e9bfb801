"""Which membership session a member holds: a group session (protocol 4) whenever its replica group has more than
one rank, else its own flat connection -- and, for a group session, where the group's leader listens.

Reference (what :func:`connect` decides, in order)::

    if group_size == 1:                          flat ("a replica group of one rank")
    elif switched off:                           flat (FaultTolerantConfig.group_session=False, or
                                                       TORCHNEXT_FT_GROUP_SESSION=0)
    elif leader_address given:                   rank 0 listens there, the others connect there
                                                       (FaultTolerantConfig.leader_address, TORCHNEXT_FT_LEADER_ADDRESS)
    elif the default process group is exactly this replica group (init_process_group(rank=group_rank,
                                                   world_size=group_size) before FaultTolerant):
        rank 0 binds a free port on the local address that routes to that group's store host, and publishes
        "host:port" in the group's store under "torchnext/ft/leader/<name>/<n>" (n: this process's n-th
        FaultTolerant of that name -- the same on every rank of the group); ranks > 0 wait for the key
    else:                                        flat ("no store shared by the replica group's ranks"), logged

The store is the replica group's own rendezvous store (torchrun's, or the one given to ``init_process_group``): a
restarted group rendezvous under a fresh prefix (torchrun makes a new agent store per restart), so a key of the
previous incarnation is not read; a follower that finds a stale address anyway (its leader is gone) reads the key
again before each connection attempt. Nothing secret is stored: the local channel authenticates both ways with the
job token (:mod:`torchnext.ft.group_session`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchnext.ft.config import FaultTolerantConfig
from torchnext.ft.group_session import GroupFollowerClient, GroupLeaderClient
from torchnext.ft.member import MemberClient
from torchnext.ft.membership import CoordinatorLost

__all__ = ["LEADER_KEY", "SessionPlan", "connect", "plan"]

_LOG = logging.getLogger("torchnext.ft")

LEADER_KEY = "torchnext/ft/leader/{name}/{n}"
"""Where a derived leader address is published in the replica group's store."""

_made: dict[str, int] = {}
_made_lock = threading.Lock()


@dataclass(frozen=True)
class SessionPlan:
    """What a member connects as: ``role`` is ``"flat"``, ``"leader"`` or ``"follower"``."""

    role: str
    address: str | None = None
    """The leader's ``host:port`` when given (``leader_address``); None when derived through ``store``."""
    store: Any = None
    """The replica group's store the leader publishes its address in (derived), else None."""
    key: str = ""
    why: str = ""
    """Why the member is flat, or how the leader's address is known (for logs and ``FaultTolerant.session``)."""


def plan(cfg: FaultTolerantConfig, *, replica_group: int | None, group_rank: int, group_size: int) -> SessionPlan:
    """Decide the session (see the module docstring); reads ``TORCHNEXT_FT_GROUP_SESSION`` and
    ``TORCHNEXT_FT_LEADER_ADDRESS`` when the config leaves them unset."""
    from torchnext._config import env_config

    if replica_group is None or group_size <= 1:
        return SessionPlan("flat", why="a replica group of one rank")
    env = env_config()
    on = cfg.group_session if cfg.group_session is not None else env.ft_group_session
    if not on:
        return SessionPlan("flat", why="group sessions switched off (group_session=False / "
                                       "TORCHNEXT_FT_GROUP_SESSION=0)")
    role = "leader" if group_rank == 0 else "follower"
    given = cfg.leader_address or env.ft_leader_address
    if given:
        return SessionPlan(role, address=given, why=f"leader_address {given}")
    store = _group_store(group_rank, group_size)
    if store is None:
        why = (f"no store shared by replica group {replica_group}'s ranks (the default process group is not this "
               f"group of {group_size}: call init_process_group(rank=group_rank, world_size=group_size) before "
               "FaultTolerant, or set leader_address)")
        _LOG.info("torchnext.ft: member of replica group %s rank %s connects flat: %s", replica_group, group_rank, why)
        return SessionPlan("flat", why=why)
    with _made_lock:
        n = _made[cfg.name] = _made.get(cfg.name, -1) + 1
    return SessionPlan(role, store=store, key=LEADER_KEY.format(name=cfg.name, n=n),
                       why="leader address published in the replica group's store")


def connect(p: SessionPlan, cfg: FaultTolerantConfig, address: str, token: str, *, replica_group: int | None,
            group_rank: int, group_size: int, **common: Any) -> MemberClient:
    """The member's client for plan ``p``: joins (a leader first gathers its followers, within ``join_timeout_s``)."""
    if p.role == "flat":
        return MemberClient(address, token, replica_group=replica_group, group_rank=group_rank,
                            group_size=group_size, **common)
    if replica_group is None:
        raise ValueError(f"a {p.role} of a group session needs a replica group")
    if p.role == "leader":
        on_listening = None if p.store is None else (lambda where: p.store.set(p.key, where))
        return GroupLeaderClient(address, token, leader_address=p.address or f"{_bind_host(p.store)}:0",
                                 replica_group=replica_group, group_size=group_size, on_listening=on_listening,
                                 gather_timeout_s=max(cfg.connect_timeout_s, cfg.join_timeout_s), **common)
    # a follower's welcome waits for every follower of its group and for its leader's join: the join's bound
    common = {**common, "connect_timeout_s": max(cfg.connect_timeout_s, cfg.join_timeout_s)}
    resolve: Callable[[], str] | None = None
    where = p.address
    if where is None:
        where = _read(p.store, p.key, common["connect_timeout_s"], replica_group)
        resolve = lambda: _read(p.store, p.key, 1.0, replica_group)  # noqa: E731  (a stale key: read again)
    return GroupFollowerClient(where, token, replica_group=replica_group, group_rank=group_rank,
                               group_size=group_size, resolve=resolve, **common)


def _read(store: Any, key: str, timeout: float, group: int) -> str:
    """The leader address published under ``key``, waiting at most ``timeout`` seconds for it."""
    try:
        store.wait([key], timedelta(seconds=timeout))
        return bytes(store.get(key)).decode()
    except Exception as exc:  # torch raises DistStoreError / RuntimeError (timeout, a store gone)
        raise CoordinatorLost(f"replica group {group}: its leader (rank 0) did not publish its local channel's "
                              f"address in the group's store ({key!r}) within {timeout}s: {exc}") from None


def _bind_host(store: Any) -> str:
    """The local address that routes to the group store's host (the followers reach that network); loopback for a
    store without a host (a ``FileStore``, a ``HashStore``: one machine)."""
    from torchnext.comms._address import store_route_address

    return store_route_address(store) or "127.0.0.1"


def _group_store(group_rank: int, group_size: int) -> Any:
    """The store of the default process group when that group is exactly this replica group, else None."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:  # a torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != group_size or dist.get_rank() != group_rank:
        return None
    return _get_default_store()
