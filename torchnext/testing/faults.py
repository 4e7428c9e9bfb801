"""Fault injectors for multi-rank tests: freeze, resume, kill, crash."""

from __future__ import annotations

import os
import signal

__all__ = ["crash_now", "freeze_self", "kill", "resume"]


def freeze_self() -> None:
    """SIGSTOP this process (it stops at once; another process must ``resume`` or ``kill`` it)."""
    os.kill(os.getpid(), signal.SIGSTOP)


def resume(pid: int) -> None:
    """SIGCONT a frozen process."""
    os.kill(pid, signal.SIGCONT)


def kill(pid: int) -> None:
    """SIGKILL a process (works on a frozen one too)."""
    os.kill(pid, signal.SIGKILL)


def crash_now(code: int = 3) -> None:
    """End this process immediately without cleanup (``os._exit``), like a crash: sockets close, nothing flushes."""
    os._exit(code)
