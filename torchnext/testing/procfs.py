"""What a harness reads from Linux ``/proc`` about its children, and forking without handing them garbage.

Standard library only: the forked workers of :mod:`torchnext.testing.member_sim` use it.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
from collections.abc import Iterator

__all__ = ["cpu_seconds", "fork_without_garbage", "is_stopped", "stat_fields", "thread_names"]


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state, ``[11]``/``[12]`` user and
    system clock ticks), or None when the process is gone (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()  # the name may hold spaces and ")": split after its last ")"
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, or None."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError):
        return None


def thread_names(pid: int | str = "self") -> collections.Counter[str]:
    """How many of process ``pid``'s threads carry each OS-level name (``/proc/<pid>/task/*/comm``: what ``top -H``
    shows; a thread without a name of its own has its creator's); empty when the process is gone."""
    names: collections.Counter[str] = collections.Counter()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                names[fh.read().strip()] += 1
        except OSError:
            continue  # ended since listed
    return names


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T``; False when it is gone)."""
    fields = stat_fields(pid)
    return fields is not None and fields[:1] == ["T"]


@contextlib.contextmanager
def fork_without_garbage() -> Iterator[None]:
    """Fork (start ``fork`` processes) inside this: a forked child inherits its parent's garbage, and a collection
    there runs finalizers written for a process that has the parent's threads -- a backend's, a store's or a pool's
    destructor that joins its worker threads waits forever in a child that has none (a CI run's worker sat
    "Garbage-collecting" until its deadline). So: collect here, where they can finish, and freeze the rest for the
    fork (the children never collect it); unfrozen afterwards, unless something had frozen objects before."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:  # what someone else froze stays frozen, with ours
            gc.unfreeze()
