"""Backend registry: a name -> a factory that builds a connected c10d backend.

A factory takes a :class:`BackendConfig` and returns a :class:`BackendHandle` whose ``pg`` is a
``torch.distributed`` c10d backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``, or any object with the same
methods: ``allreduce``, ``broadcast``, ``reduce``, ``allgather``, ``_allgather_base``, ``reduce_scatter``,
``_reduce_scatter_base``, ``alltoall``, ``alltoall_base``, ``gather``, ``scatter``, ``send``, ``recv``,
``barrier``). The factory must return a **connected** backend (eager): the Communicator is usable on return.

Built in: ``"gloo"`` (:mod:`.gloo`) and ``"nccl"`` (:mod:`.nccl`, needs CUDA). Add one with::

    register_backend("mine", lambda cfg: BackendHandle(pg=MyPG(cfg.store, cfg.rank, cfg.size), device=...))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = ["BackendConfig", "BackendFactory", "BackendHandle", "backend_names", "get_backend", "register_backend"]


@dataclass(kw_only=True, frozen=True)
class BackendConfig:
    """What a backend factory receives."""

    store: Any
    """A ``torch.distributed.Store`` already namespaced for this communicator (use it as is)."""
    rank: int
    """Rank in the communicator."""
    size: int
    """Number of members."""
    timeout: timedelta
    """Default op timeout of the communicator (also the connection timeout)."""
    device: torch.device | None
    """Device asked for by the user; None lets the backend choose its default."""
    name: str
    """Communicator name (for logs)."""


@dataclass(kw_only=True)
class BackendHandle:
    """A connected backend plus what the Communicator needs to know about it."""

    pg: Any
    """The c10d backend object the ops are issued on."""
    device: torch.device
    """Device of the tensors it communicates."""
    native_avg: bool = True
    """Whether ``ReduceOp.AVG`` can be passed to the backend (else SUM + divide is used)."""
    interruptible_wait: bool = False
    """Whether ``backend_work.wait(timeout)`` on a collective only stops waiting when ``timeout`` elapses (c10d's
    generic ``Work::wait``) rather than failing the op: then sync ops wait in short slices on the issuing thread
    (fastest, still abortable). Gloo: True. Otherwise sync ops wait like async ones (future callback)."""
    futureless_ops: frozenset[str] = frozenset()
    """Ops whose backend Work has no future and whose timed wait is not a plain wait (Gloo's reduce_scatter: it
    ignores the timeout and never reports ``is_completed()``): they are waited on untimed, by a waiter thread."""
    uneven_all_to_all: bool = False
    """Whether the list-form ``alltoall`` accepts chunks of different sizes (else it is emulated)."""
    abort_fn: Callable[[], None] | None = None
    """Cancels in-flight work in the backend itself (NCCL); None when the backend cannot (Gloo)."""
    shutdown_fn: Callable[[], None] | None = None
    """Clean release of resources, called by ``Communicator.shutdown()``; None: drop the reference."""
    cancel_fn: Callable[[], int] | None = None
    """Makes every op still running on an abandoned backend end promptly (with an error), so that it can be
    released (see :mod:`torchnext.comms.reaper`); returns how many channels it cut. Gloo: shuts the device's pair
    sockets down (:mod:`.gloo_sockets`). None: the ops end at their own timeout."""


BackendFactory = Callable[[BackendConfig], BackendHandle]

# name -> factory, or "module:function" resolved lazily (keeps `import torchnext.comms` free of CUDA probing).
_REGISTRY: dict[str, BackendFactory | str] = {
    "gloo": "torchnext.comms.backends.gloo:create",
    "nccl": "torchnext.comms.backends.nccl:create",
}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``Communicator(..., backend=name)`` use ``factory``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"backend factory for {name!r} must be callable, got {factory!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True to override)")
    _REGISTRY[name] = factory


def get_backend(name: str) -> BackendFactory:
    """The factory registered under ``name``; ``ValueError`` listing the known names otherwise."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}")
    if isinstance(entry, str):
        module, attr = entry.split(":")
        factory: BackendFactory = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = factory
        return factory
    return entry


def backend_names() -> list[str]:
    """Registered backend names."""
    return sorted(_REGISTRY)
