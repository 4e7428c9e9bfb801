"""Coordinators as real processes (``torchnext coordinator``), for failover tests: start, address, kill, always reap.

::

    with CoordinatorProcess(token, initial_size=4) as primary, CoordinatorProcess(token, standby=True) as standby:
        addresses = f"{primary.address},{standby.address}"     # the members' TORCHNEXT_FT_COORDINATOR
        ...
        primary.kill()                                          # SIGKILL: its store and connections die with it

``prefix`` runs the process under another command (``["ip", "netns", "exec", "ns1"]``: inside a network
namespace, see :mod:`torchnext.testing.netns`). The process's output is kept (``output()``) for failure messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["CoordinatorProcess"]


def _pythonpath() -> str:
    """PYTHONPATH that makes a child import this very torchnext (a worktree's, not an installed one)."""
    import torchnext

    root = os.path.dirname(os.path.dirname(os.path.abspath(torchnext.__file__)))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


class CoordinatorProcess:
    """One ``torchnext coordinator`` process (see the module docstring). ``start()`` returns once it listens
    (``address``, ``pid``); ``kill()`` SIGKILLs it; ``close()`` (or ``with``) kills and reaps it."""

    def __init__(self, token: str, *, host: str = "127.0.0.1", port: int = 0, standby: bool = False, min_size: int = 1,
                 initial_size: int | None = None, heartbeat_interval_s: float | None = None,
                 heartbeat_timeout_s: float | None = None, quorum_timeout_s: float | None = None,
                 prefix: Sequence[str] = (), extra: Sequence[str] = (), start_timeout_s: float = 60.0) -> None:
        if not token:
            raise ValueError("CoordinatorProcess needs the job token")
        args = [sys.executable, "-m", "torchnext", "coordinator", "--host", host, "--port", str(port), "--min-size",
                str(min_size), "--no-exit-when-done"]
        if initial_size is not None:
            args += ["--initial-size", str(initial_size)]
        for flag, value in (("--heartbeat-interval", heartbeat_interval_s), ("--heartbeat-timeout",
                            heartbeat_timeout_s), ("--quorum-timeout", quorum_timeout_s)):
            if value is not None:
                args += [flag, str(value)]
        if standby:
            args.append("--standby")
        self.command = [*prefix, *args, *extra]
        self.token = token
        self.standby = standby
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self._lines: list[str] = []
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> CoordinatorProcess:
        """Launch and wait until it listens (``launch()`` then ``wait_ready()``)."""
        return self.launch().wait_ready()

    def launch(self) -> CoordinatorProcess:
        """Start the process without waiting (start several, then ``wait_ready`` each: they import torch in
        parallel)."""
        env = {**os.environ, "TORCHNEXT_FT_TOKEN": self.token, "PYTHONPATH": _pythonpath()}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, stdin=subprocess.DEVNULL)
        self._ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self._lines.append(line)
                if "listening on" in line and not self.address:
                    self.address = line.split("listening on ")[1].split()[0]
                    self._ready.set()
            self._ready.set()

        self._reader = threading.Thread(target=read, name="coordinator-output", daemon=True)
        self._reader.start()
        return self

    def wait_ready(self) -> CoordinatorProcess:
        """Wait until the launched process listens (``address`` set); kills it and raises ``RuntimeError`` with
        its output otherwise."""
        if self.proc is None:
            raise RuntimeError("CoordinatorProcess.wait_ready() before launch()")
        if not self._ready.wait(self.start_timeout_s) or not self.address:
            out = self.output()
            self.close()
            raise RuntimeError(f"torchnext coordinator did not start within {self.start_timeout_s}s: {out[-2000:]}")
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("CoordinatorProcess not started")
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL the coordinator and reap it; returns ``time.monotonic()`` at the kill."""
        at = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)
        return at

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the coordinator stops serving and exits 0) and reap; returns the exit code (None: still running
        after ``timeout`` -- then it is SIGKILLed by ``close()``)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return int(self.proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            return None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def output(self) -> str:
        return "".join(self._lines)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass
        if self._reader is not None:
            self._reader.join(timeout=5)

    def __enter__(self) -> CoordinatorProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()
