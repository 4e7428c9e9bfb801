"""The ``"torchnext"`` c10d backend: what ``dist.init_process_group(backend="torchnext")`` and ``dist.new_group``
build, and ``comm.as_process_group()`` for a Communicator that already exists.

``import torchnext`` registers the backend name with torch (``dist.Backend.register_backend``, devices cpu and
cuda); torch then calls :func:`create` for every group it makes:

* the default group: one Communicator per device type over torch's store -- Gloo for CPU tensors, NCCL for CUDA
  tensors when CUDA and NCCL are available (``TORCHNEXT_PG_CUDA_BACKEND``: ``nccl`` (default) or ``none``); a
  Flight Recorder records them (ring size ``TORCHNEXT_FR_BUFFER_SIZE``, else ``TORCH_FR_BUFFER_SIZE``, default
  2000; 0 disables; automatic dumps -- on a timeout, a peer failure, an error, ``abort()``, and ``SIGUSR1`` when
  nothing else handles that signal -- to ``TORCHNEXT_FR_DUMP_DIR``, else the folder of ``TORCH_FR_DUMP_TEMP_FILE``,
  as JSON and as the pickle torchfrtrace reads);
* ``dist.new_group(ranks)``: a child of the default group's Communicators (``Communicator.child``, so the same
  recorder records it), over the store namespace torch gives the group; when the default group is not a torchnext
  one, fresh Communicators over that namespace.

Only torch's own bookkeeping knows the groups by name; we keep nothing global but the process's recorder.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchnext._config import env_config
from torchnext.comms.communicator import Communicator
from torchnext.comms.flight_recorder import FlightRecorder
from torchnext.comms.process_group.group import BACKEND_NAME, TorchnextProcessGroup

__all__ = ["as_process_group", "create", "cuda_backend", "recorder"]

_RECORDER: list[FlightRecorder] = []  # the process's recorder for groups torch creates (made once)


def recorder(rank: int, world_size: int) -> FlightRecorder | None:
    """The Flight Recorder of the groups this process creates through torch (None when disabled)."""
    if _RECORDER:
        return _RECORDER[0]
    cfg = env_config()
    capacity = cfg.pg_fr_buffer_size
    if capacity == 0:
        return None
    rec = FlightRecorder(capacity, rank=rank, world_size=world_size, dump_dir=cfg.pg_fr_dump_dir,
                         auto_dump_formats=("json", "pickle"))  # pickle: what torchfrtrace reads
    if (cfg.pg_fr_dump_dir is not None and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL):
        rec.enable_dump_on_signal(signal.SIGUSR1)  # only where nobody else handles it (its default: terminate)
    _RECORDER.append(rec)
    return rec


def cuda_backend() -> str | None:
    """The backend of the CUDA Communicator of new groups: ``"nccl"`` when CUDA and NCCL are available (and not
    turned off with ``TORCHNEXT_PG_CUDA_BACKEND=none``), else None (CPU tensors only)."""
    choice = env_config().pg_cuda_backend
    if choice == "none" or not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    return choice


def _communicators(store: dist.Store, rank: int, size: int, timeout: timedelta, ranks: Sequence[int],
                   name: str) -> dict[str, Communicator]:
    rec = recorder(ranks[rank], max(ranks) + 1)
    comms = {"cpu": Communicator(store, rank, size, backend="gloo", timeout=timeout, name=name,
                                 global_ranks=ranks, flight_recorder=rec if rec is not None else False)}
    cuda = cuda_backend()
    if cuda is not None:
        device = torch.device("cuda", torch.cuda.current_device())
        comms["cuda"] = Communicator(store, rank, size, backend=cuda, timeout=timeout, name=f"{name}.cuda",
                                     device=device, global_ranks=ranks,
                                     flight_recorder=rec if rec is not None else False)
    return comms


def create(common: Any, _backend_options: Any = None) -> TorchnextProcessGroup:
    """torch's backend creator (``register_backend(..., extended_api=True)``): the group for ``common``
    (``_DistributedBackendOptions``: store, group_rank, group_size, timeout, group_id, global_ranks_in_group)."""
    store, rank, size = common.store, int(common.group_rank), int(common.group_size)
    timeout = common.timeout
    global_ranks = list(common.global_ranks_in_group) or list(range(size))
    name = f"pg{common.group_id}"
    world = dist.group.WORLD if dist.is_initialized() else None
    if isinstance(world, TorchnextProcessGroup) and common.global_ranks_in_group:
        parents = world.communicators
        comms = {}
        for device, parent in parents.items():
            parent_ranks = parent.ranks
            members = [parent_ranks.index(g) for g in global_ranks]
            comms[device] = parent.child(store, members, name=name if device == "cpu" else f"{name}.{device}",
                                         timeout=timeout)
    else:
        comms = _communicators(store, rank, size, timeout, global_ranks, name)
    return TorchnextProcessGroup(comms, description=name)


def as_process_group(comm: Communicator, *, name: str | None = None) -> TorchnextProcessGroup:
    """``comm.as_process_group()``: the torch.distributed group over ``comm`` (the same object on every call).

    Registered in torch's bookkeeping under ``name`` (default ``torchnext:<comm.name>``), so that functional
    collectives and ``torch.compile`` resolve it by name, and -- when a default group exists --
    ``dist.get_rank(pg)``/``dist.get_process_group_ranks(pg)`` know it (``comm.ranks`` are taken as global ranks).
    """
    pg = comm.extensions.get("process_group")
    if pg is not None:
        return pg
    pg = TorchnextProcessGroup({comm.device.type: comm}, description=comm.name)
    group_name = name or f"torchnext:{comm.name}"
    pg.setGroupName(group_name)
    _register(pg, group_name, comm)
    comm.extensions["process_group"] = pg
    return pg


def _register(pg: TorchnextProcessGroup, group_name: str, comm: Communicator) -> None:
    """Enter ``pg`` in torch's tables the way ``new_group`` does (torch 2.13 and 2.14 share this helper)."""
    c10d: Any = dist.distributed_c10d
    mapping = {g: r for r, g in enumerate(comm.ranks)}
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(pg, BACKEND_NAME, comm.store, group_name, BACKEND_NAME, rank_mapping=mapping)
        return
    c10d._world.pg_map[pg] = (BACKEND_NAME, comm.store)  # pragma: no cover - older torch
    c10d._world.pg_names[pg] = group_name
    c10d._world.pg_backend_config[pg] = BACKEND_NAME
    c10d._world.pg_group_ranks[pg] = mapping
    c10d._register_process_group(group_name, pg)
