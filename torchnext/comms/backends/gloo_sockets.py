"""Cancelling a Gloo backend's ops from outside: the pair sockets its device watches, found and shut down.

Gloo has no abort (``ProcessGroupGloo.abort()`` returns and does nothing): an op blocked on a dead or hung peer runs
to its timeout, and the backend cannot be destroyed before (its destructor joins the worker thread). But every Gloo
TCP device owns one ``epoll`` instance that watches its listener, a wake-up pipe and every pair socket, and the
kernel lists an epoll's watched files in ``/proc/self/fdinfo/<epfd>`` (``tfd: <fd> ... ino:<hex inode>``). So::

    with _DEVICE_LOCK:                          # one device created at a time in this process
        before = inodes of every open file
        device = ProcessGroupGloo.create_device(...)
        (epfd,) = [ep for ep in epolls() if it watches a file not in before]   # ambiguous: no cancel
    ...
    def cancel():                               # on abort
        for fd, inode in watched(epfd):         # the epoll's entries now
            d = os.dup(fd)                      # race-free: d is whatever fd is *now* ...
            if fstat(d).st_ino == inode and is a connected socket:   # ... and it is the watched socket
                shutdown(d, SHUT_RDWR)          # Gloo's pair sees EOF: its ops fail at once (IoException)
            close(d)

Measured (torch 2.13, loopback): an all_reduce blocked on an absent peer raised 1 ms after ``cancel()``, and the
backend's destructor then took 0.1 ms. The peers' ends see the connection closed (a ``PeerFailure`` there), as after
any other abort of a member. The listener and the pipe are left alone (not connected sockets).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["cancel_sockets", "create_watched_device"]

_DEVICE_LOCK = threading.Lock()
_PROC_FD = "/proc/self/fd"


def _fds() -> list[tuple[int, str, int]]:
    """``(fd, link, inode)`` of this process's open files."""
    out: list[tuple[int, str, int]] = []
    try:
        names = os.listdir(_PROC_FD)
    except OSError:
        return out
    for name in names:
        try:
            path = f"{_PROC_FD}/{name}"
            out.append((int(name), os.readlink(path), os.stat(path).st_ino))
        except (OSError, ValueError):
            continue
    return out


def watched(epfd: int) -> list[tuple[int, int]]:
    """``(fd, inode)`` of the files epoll instance ``epfd`` watches (empty when it cannot be read)."""
    out = []
    try:
        with open(f"/proc/self/fdinfo/{epfd}") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        if not line.startswith("tfd:"):
            continue
        parts = line.split()
        try:
            fd = int(parts[1])
            ino = next(int(p[4:], 16) for p in parts if p.startswith("ino:"))
        except (IndexError, ValueError, StopIteration):
            continue
        out.append((fd, ino))
    return out


def create_watched_device(make: Callable[[], Any]) -> tuple[Any, tuple[int, int] | None]:
    """``make()`` (creates one Gloo device) and the ``(fd, inode)`` of the epoll instance it created, or None when
    that cannot be told (no ``/proc``, or something else created an epoll of only new files in the same moment).

    The device's epoll is the one that watches files *all* created meanwhile (its pipe and listener). An epoll's own
    fd number and inode say nothing (every epoll shares one anonymous inode, and a closed one's fd is reused); and
    "watches *a* new file" is not enough: a live device's epoll gains a pair socket whenever another thread connects
    a process group on it meanwhile (fault tolerance builds the next generation's groups beside the running ones) --
    that ambiguity left the new backend without a canceller, so that an abort could not cut its ops short (they ran
    to their timeout, and the abandoned backend's threads and fds stayed that long)."""
    with _DEVICE_LOCK:
        before = {ino for _, _, ino in _fds()}
        device = make()
        only_new, some_new = [], []
        for fd, link, ino in _fds():
            if link != "anon_inode:[eventpoll]":
                continue
            files = watched(fd)
            if any(w not in before for _, w in files):
                some_new.append((fd, ino))
                if all(w not in before for _, w in files):
                    only_new.append((fd, ino))
    # the one epoll of only new files; else (a device that also watches an old file -- not seen with torch 2.13)
    # the one epoll that gained any
    for mine in (only_new, some_new):
        if len(mine) == 1:
            return device, mine[0]
    return device, None


def cancel_sockets(epoll: tuple[int, int]) -> int:
    """Shut down every connected socket the epoll instance ``epoll`` (``(fd, inode)``) watches; returns how many.
    (The epoll's fd stays that epoll while its backend is alive: the caller cancels before releasing it.)"""
    epfd, ep_ino = epoll
    cut = 0
    dup = _dup_if(epfd, ep_ino)
    if dup is None:
        return 0
    try:
        entries = watched(dup)
    finally:
        os.close(dup)
    for fd, ino in entries:
        d = _dup_if(fd, ino)
        if d is None:
            continue
        try:
            if not stat.S_ISSOCK(os.fstat(d).st_mode):
                continue
            s = socket.socket(fileno=d)
            d = -1  # owned by s now
            try:
                s.getpeername()  # a connected pair socket (the listener has no peer)
                s.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
            finally:
                s.close()  # closes only our duplicate; Gloo's fd stays open (now shut down)
        finally:
            if d >= 0:
                os.close(d)
    return cut


def _dup_if(fd: int, inode: int) -> int | None:
    """A duplicate of ``fd`` when it refers to the file with ``inode`` (then it stays that file however ``fd`` is
    reused meanwhile), else None."""
    try:
        d = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(d).st_ino == inode:
            return d
    except OSError:
        pass
    os.close(d)
    return None
