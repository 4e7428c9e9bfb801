"""torch's process-group timeout setters on torchnext groups.

``ProcessGroup.set_timeout`` (and ``dist.set_timeout``, torch >= 2.14, which calls it) reach
:meth:`TorchnextProcessGroup.set_timeout` as any method does. torch 2.13's private
``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)`` -- what trainers call on torch 2.13, where
``dist.set_timeout`` does not exist -- looks only for ``ProcessGroupGloo``/``ProcessGroupNCCL`` backends and, finding
none in a torchnext group, warns and changes nothing. :func:`install` (run once when torchnext registers its
backend) wraps it::

    def _set_pg_timeout(timeout, group=None):
        pg = group or default_group()
        if isinstance(pg, TorchnextProcessGroup): pg.set_timeout(timeout)
        else: torch_original(timeout, group)

A module that bound ``_set_pg_timeout`` by name before ``import torchnext`` keeps torch's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchnext.comms.process_group.group import TorchnextProcessGroup

__all__ = ["install", "set_timeout"]

_MARK = "__torchnext_timeouts__"


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Set the default op timeout of ``group`` (None: the default group), torchnext or not.

    Raises:
        TypeError: ``timeout`` is not a ``timedelta``.
        ValueError: ``timeout`` is not positive, or no default group exists.
    """
    if not isinstance(timeout, timedelta):
        raise TypeError(f"set_timeout: timeout must be a datetime.timedelta, got {timeout!r}")
    pg = group if group is not None else c10d.GroupMember.WORLD
    if pg is None:
        raise ValueError("set_timeout: no process group given and no default group initialised")
    if isinstance(pg, TorchnextProcessGroup):
        pg.set_timeout(timeout)
        return
    _original(timeout, pg)


def _original(timeout: timedelta, group: dist.ProcessGroup | None) -> None:
    fn = getattr(c10d._set_pg_timeout, "__wrapped__", c10d._set_pg_timeout)
    fn(timeout, group)


def install() -> None:
    """Wrap ``torch.distributed.distributed_c10d._set_pg_timeout`` so it reaches torchnext groups (idempotent)."""
    current: Callable[..., Any] = c10d._set_pg_timeout
    if getattr(current, _MARK, False):
        return

    @functools.wraps(current)
    def _set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        pg = group if group is not None else c10d.GroupMember.WORLD
        if isinstance(pg, TorchnextProcessGroup):
            pg.set_timeout(timeout)
        else:
            current(timeout, group)

    setattr(_set_pg_timeout, _MARK, True)
    c10d._set_pg_timeout = _set_pg_timeout
