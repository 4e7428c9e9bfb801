"""What every compiled-on-first-use extension shares: a lock with a deadline, bounded compiler runs, one line when a
build starts and one when it ends, and pruning of builds nobody used for a long time.

Two extensions use it: the CPU kernels (:mod:`torchnext.lowp.cpu`, the compiler run directly) and the native
process-group path (:mod:`torchnext.comms.native`, ``torch.utils.cpp_extension``). Their cache folders sit side by
side in ``TORCHNEXT_KERNEL_CACHE`` as ``<name>-<key>/`` with a ``build.json`` once built, and a lock file
``.<name>-<key>.lock`` next to each.

Semantics, as a tiny reference::

    with build_lock(lock_path, timeout_s):      # flock, polled; another process's build is waited for at most
        ...                                     # timeout_s, then BuildTimeout (the caller falls back, warning)
    run_commands(cmds, timeout_s=t, jobs=n)     # at most n at once (default: the cores this process may use);
                                                # one past t seconds is killed -> BuildTimeout; a failure -> the
                                                # first failing command's output in a RuntimeError
    with announced(what, why, folder, s):       # stderr: "torchnext: building <what> (<why>; about <s> s, ...)"
        ...                                     # then "torchnext: built <what> in <t> s (cached in <folder>)",
                                                # or "... failed after <t> s: <the error's first line>" (re-raised)
    prune(cache_dir, keep=folder, days=d)       # remove <name>-* builds (any name) last used > d days ago

Where ``fcntl`` does not exist (Windows), the lock is a file created with ``O_EXCL`` holding the owner's pid; a
file whose owner is gone is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the O_EXCL lock file below
    fcntl = None  # type: ignore[assignment]

__all__ = ["BuildTimeout", "announced", "build_lock", "jobs", "prune", "run_commands", "touch", "typical_seconds"]

_POLL_S = 0.05
BUILD_MARKER = "build.json"


class BuildTimeout(RuntimeError):
    """A build step ran past its deadline (a hung compiler, or another process's build that never ends)."""


def jobs() -> int:
    """Compiler processes to run at once: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def build_lock(path: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created if needed) for the body; wait at most ``timeout_s`` for it.

    Raises:
        BuildTimeout: another process held it for ``timeout_s`` (its build is still running, or hung).
    """
    deadline = time.monotonic() + timeout_s
    if fcntl is not None:
        with open(path, "a") as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BuildTimeout(f"another process held the build lock {path} for {timeout_s:.0f} s "
                                           "(TORCHNEXT_BUILD_TIMEOUT)") from None
                    time.sleep(_POLL_S)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    with _exclusive_file(path, deadline, timeout_s):
        yield


@contextlib.contextmanager
def _exclusive_file(path: Path, deadline: float, timeout_s: float) -> Iterator[None]:
    """The lock without ``fcntl``: ``path`` created with ``O_EXCL`` holds our pid; a dead owner's file is removed."""
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if _owner_gone(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            if time.monotonic() > deadline:
                raise BuildTimeout(f"another process held the build lock {path} for {timeout_s:.0f} s "
                                   "(TORCHNEXT_BUILD_TIMEOUT)") from None
            time.sleep(_POLL_S)
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _owner_gone(path: Path) -> bool:
    try:
        pid = int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return False  # being written right now, or unreadable: not ours to remove
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def run_commands(cmds: Sequence[Sequence[str]], *, timeout_s: float, max_jobs: int | None = None,
                 env: dict[str, str] | None = None) -> None:
    """Run ``cmds`` with at most ``max_jobs`` (default :func:`jobs`) at once, each for at most ``timeout_s``.

    Raises:
        BuildTimeout: a command ran past ``timeout_s`` (it and every other running one are killed).
        RuntimeError: a command failed (the first failure's command and the tail of its output).
    """
    width = max(1, max_jobs if max_jobs is not None else jobs())
    todo = list(cmds)
    running: list[tuple[Sequence[str], subprocess.Popen[str], float]] = []
    failure: str | None = None
    try:
        while todo or running:
            while todo and len(running) < width and failure is None:
                cmd = todo.pop(0)
                # its own session: a timeout kills what it started too (ninja, the compiler under it)
                proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, start_new_session=os.name == "posix")
                running.append((cmd, proc, time.monotonic() + timeout_s))
            if failure is not None and not running:
                break
            cmd, proc, deadline = running[0]
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BuildTimeout(f"`{_short(cmd)}` ran past {timeout_s:.0f} s (TORCHNEXT_BUILD_TIMEOUT); "
                                   "killed") from None
            running.pop(0)
            if proc.returncode != 0 and failure is None:
                tail = "\n".join(out.strip().splitlines()[-15:])
                failure = f"`{_short(cmd)}` exited with {proc.returncode}:\n{tail}"
    finally:
        for _, proc, _ in running:
            _kill_tree(proc)
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                proc.communicate(timeout=5.0)
    if failure is not None:
        raise RuntimeError(failure)


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` and, on POSIX, every process of its session (it was started as the session's leader)."""
    if os.name == "posix":
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)  # SIGKILL; the group outlives a leader that already exited
    elif proc.poll() is None:
        proc.kill()


def _short(cmd: Sequence[str]) -> str:
    return f"{' '.join(cmd[:2])} ... {cmd[-1]}" if len(cmd) > 3 else " ".join(cmd)


def typical_seconds(cache_dir: Path, name: str, default_s: float) -> float:
    """How long a build of ``name`` took here before (the newest ``build.json`` of any ``<name>-*`` folder), else
    ``default_s``."""
    best: tuple[float, float] | None = None
    with contextlib.suppress(OSError):
        for folder in cache_dir.glob(f"{name}-*"):
            marker = folder / BUILD_MARKER
            try:
                seconds = float(json.loads(marker.read_text())["seconds"])
                when = marker.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if best is None or when > best[0]:
                best = (when, seconds)
    return best[1] if best is not None else default_s


@contextlib.contextmanager
def announced(what: str, why: str, folder: Path, expected_s: float) -> Iterator[None]:
    """One line on stderr when the body (a build) starts -- what, why, roughly how long, where it is cached -- and
    one when it ends: its time, or why it failed (the exception is re-raised)."""
    print(f"torchnext: building {what} ({why}; about {expected_s:.0f} s, once: cached in {folder})",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        yield
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        print(f"torchnext: building {what} failed after {time.perf_counter() - t0:.1f} s: {first}", file=sys.stderr,
              flush=True)
        raise
    print(f"torchnext: built {what} in {time.perf_counter() - t0:.1f} s (cached in {folder})", file=sys.stderr,
          flush=True)


def touch(folder: Path) -> None:
    """Mark a cached build as used now (what :func:`prune` goes by)."""
    with contextlib.suppress(OSError):
        os.utime(folder / BUILD_MARKER)


def prune(cache_dir: Path, *, keep: Path, days: int) -> list[Path]:
    """Remove the builds in ``cache_dir`` (``*-<key>`` folders with a ``build.json``) not used for ``days`` days,
    except ``keep``; a build whose lock another process holds is left alone. ``days`` 0 removes nothing. Returns what
    was removed."""
    if days <= 0:
        return []
    removed = []
    cutoff = time.time() - days * 86400.0
    with contextlib.suppress(OSError):
        for folder in cache_dir.iterdir():
            marker = folder / BUILD_MARKER
            if folder == keep or not folder.is_dir() or not marker.exists():
                continue
            try:
                if marker.stat().st_mtime > cutoff:
                    continue
                lock = cache_dir / f".{folder.name}.lock"
                with build_lock(lock, timeout_s=0.0):
                    shutil.rmtree(folder)
                    with contextlib.suppress(OSError):
                        os.unlink(lock)
                removed.append(folder)
            except (OSError, BuildTimeout):
                continue
    return removed
