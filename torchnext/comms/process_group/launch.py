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
"""

from __future__ import annotations

import functools
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from torchnext.comms.process_group.group import BACKEND_NAME

__all__ = ["SWAPPED_BACKENDS", "main", "run_argv", "swap_backend", "swap_backends"]

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


def main(argv: Sequence[str] | None = None) -> None:
    """The worker side: ``python -m torchnext.comms.process_group.launch (script.py | -m module) [args]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m torchnext.comms.process_group.launch (script.py | -m module) [args]")
    swap_backends()
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
