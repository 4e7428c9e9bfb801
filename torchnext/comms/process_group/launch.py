"""``torchnext run``: torchrun with torchnext process groups, for a training script nobody can edit.

``torchnext run [torchrun options] script.py [args]`` is torchrun -- its options, its rendezvous, its elastic agent
-- with one difference: every worker runs ``script.py`` (or ``-m module``) through this module, which first swaps
the backend of ``torch.distributed.init_process_group`` / ``new_group``: ``gloo``, ``nccl``, their ``cpu:...,cuda:...``
combinations and "no backend given" become ``"torchnext"`` (Gloo underneath for CPU tensors, NCCL for CUDA ones).
Any other backend is left alone. Semantics::

    torchnext run --standalone --nproc-per-node 2 train.py --lr 0.1
    # == torchrun --standalone --nproc-per-node 2 -m torchnext.comms.process_group.launch train.py --lr 0.1
    # where each worker does: swap_backends(); runpy.run_path("train.py", run_name="__main__")

A script that can be edited needs none of this: ``import torchnext`` and ``backend="torchnext"``.

Restarts (``--max-restarts``): torchrun's agent keeps one store for the whole job and its workers' ``env://``
rendezvous writes every attempt's keys into it without an attempt prefix, so a restarted worker can read the dead
attempt's addresses (its first ``init_process_group`` then fails "Connection refused"). On one node (one agent:
``GROUP_WORLD_SIZE=1``) ``torchnext run``'s workers rendezvous under ``torchnext-run-<TORCHELASTIC_RESTART_COUNT>/``
instead (:func:`rendezvous_per_restart`): an ``init_process_group`` that names no store and no other init method
gets ``store=PrefixStore("torchnext-run-<restart>/", <the env:// store>)``. Across several nodes the agents count
restarts each on their own (a restart for a membership change is not counted), so the prefix could differ between
nodes; there the rendezvous is torch's, unchanged.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from torchnext.comms.process_group.group import BACKEND_NAME

__all__ = ["SWAPPED_BACKENDS", "main", "rendezvous_per_restart", "restart_prefix", "run_argv", "swap_backend",
           "swap_backends"]

SWAPPED_BACKENDS = frozenset({"gloo", "nccl", "cpu:gloo", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"})
"""Backends (lower case, without spaces) that ``torchnext run`` replaces by ``"torchnext"``."""

_MARK = "_torchnext_swapped"


def swap_backend(backend: Any) -> Any:
    """``"torchnext"`` for None and the names in :data:`SWAPPED_BACKENDS`; anything else unchanged."""
    if backend is None or (isinstance(backend, str) and backend.lower().replace(" ", "") in SWAPPED_BACKENDS):
        return BACKEND_NAME
    return backend


def _wrap(fn: Callable[..., Any], position: int) -> Callable[..., Any]:
    """``fn`` with its ``backend`` argument (keyword, or positional at ``position``) passed through swap_backend."""
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def swapped(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs or len(args) <= position:
            kwargs["backend"] = swap_backend(kwargs.get("backend"))
        else:
            args = (*args[:position], swap_backend(args[position]), *args[position + 1:])
        return fn(*args, **kwargs)

    setattr(swapped, _MARK, True)
    return swapped


def swap_backends() -> None:
    """Make ``dist.init_process_group`` and ``dist.new_group`` build torchnext groups (idempotent)."""
    import torchnext  # noqa: F401  (registers the backend)

    c10d: Any = dist.distributed_c10d
    for name, position in (("init_process_group", 0), ("new_group", 2)):
        wrapped = _wrap(getattr(c10d, name), position)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def restart_prefix() -> str | None:
    """``"torchnext-run-<TORCHELASTIC_RESTART_COUNT>/"`` for a worker of a one-node torchrun job
    (``GROUP_WORLD_SIZE=1``), else None (not under torchrun, or several nodes: see the module docstring)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    return f"torchnext-run-{restart}/"


_RESTART_MARK = "_torchnext_per_restart"


def rendezvous_per_restart() -> None:
    """Make ``dist.init_process_group`` rendezvous under :func:`restart_prefix` (idempotent; a no-op where it is
    None). Semantics of the wrapped call, when it names no ``store`` and ``init_method`` is None or ``"env://"``::

        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)                       # timeout: the call's, else torch's default (30 min)
        init_process_group(backend, store=PrefixStore(restart_prefix(), store), rank=rank,
                           world_size=world_size, ...)   # every other argument unchanged

    Any other call passes through unchanged. ``new_group`` needs nothing: its groups live under the default group's
    store."""
    prefix = restart_prefix()
    c10d: Any = dist.distributed_c10d
    fn = c10d.init_process_group
    if prefix is None or getattr(fn, _RESTART_MARK, False):
        return

    @functools.wraps(fn)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= 1 and kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            from torch.distributed.constants import default_pg_timeout

            timeout = kwargs.get("timeout") or default_pg_timeout
            store, rank, world_size = next(iter(dist.rendezvous(
                "env://", kwargs.get("rank", -1), kwargs.get("world_size", -1), timeout=timeout)))
            store.set_timeout(timeout)
            kwargs.pop("init_method", None)
            kwargs.update(store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size)
        return fn(*args, **kwargs)

    setattr(init_process_group, _RESTART_MARK, True)  # (functools.wraps kept the backend swap's mark)
    c10d.init_process_group = dist.init_process_group = init_process_group


def main(argv: Sequence[str] | None = None) -> None:
    """The worker side: ``python -m torchnext.comms.process_group.launch (script.py | -m module) [args]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m torchnext.comms.process_group.launch (script.py | -m module) [args]")
    swap_backends()
    rendezvous_per_restart()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("-m needs a module name")
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")


# ------------------------------------------------------------------------------- `torchnext run` (the CLI)
def run_argv(argv: Sequence[str]) -> int:
    """``torchnext run ARGV``: parse ``argv`` with torchrun's own parser, then run every worker through
    :func:`main`. (A raw-arguments subcommand: torchrun's options pass through untouched.)"""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "torchnext run"
    parsed = parser.parse_args(list(argv))
    if parsed.no_python:
        raise SystemExit("torchnext run: --no-python is not supported (the workers must run Python)")
    script = ["-m", parsed.training_script] if parsed.module else [parsed.training_script]
    parsed.training_script_args = [*script, *parsed.training_script_args]
    parsed.training_script = "torchnext.comms.process_group.launch"
    parsed.module = True
    torchrun.run(parsed)
    return 0


if __name__ == "__main__":
    main()
