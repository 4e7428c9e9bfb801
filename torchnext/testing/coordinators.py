"""Coordinators as real processes (``torchnext coordinator``), for failover tests: start, address, kill, always reap.

::

    with CoordinatorProcess(token, initial_size=4) as primary, CoordinatorProcess(token, standby=True) as standby:
        addresses = f"{primary.address},{standby.address}"     # the members' TORCHNEXT_FT_COORDINATOR
        ...
        primary.kill()                                          # SIGKILL: its store and connections die with it

``prefix`` runs the process under another command (``["ip", "netns", "exec", "ns1"]``: inside a network
namespace, see :mod:`torchnext.testing.netns`). The process's output is kept (``output()``) for failure messages.

``fork=True`` forks it from the test processes' forkserver instead (torch preloaded, see
:mod:`torchnext.testing.multiprocess`) -- ``netns=`` then names the namespace it enters itself: a fresh
``python -m torchnext coordinator`` spends ~2.6 s of CPU importing torch, which a soak on a 2-core machine takes from
the members training beside it at every coordinator restart. Same command line, same output, same signals.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

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
                 prefix: Sequence[str] = (), extra: Sequence[str] = (), start_timeout_s: float = 60.0,
                 fork: bool = False, netns: str | None = None) -> None:
        if not token:
            raise ValueError("CoordinatorProcess needs the job token")
        if netns is not None and not fork:
            raise ValueError("CoordinatorProcess: netns= is for fork=True (else pass prefix=lab.prefix(host))")
        if fork and prefix:
            raise ValueError("CoordinatorProcess: a forked coordinator runs no prefix command (use netns=)")
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
        self.fork = fork
        self.netns = netns
        self.token = token
        self.standby = standby
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | _Forked | None = None
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
        out: IO[str] | None
        if self.fork:
            self.proc = _Forked(self.command[3:], {"TORCHNEXT_FT_TOKEN": self.token}, self.netns)
            out = self.proc.stdout
        else:
            env = {**os.environ, "TORCHNEXT_FT_TOKEN": self.token, "PYTHONPATH": _pythonpath()}
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env=env, stdin=subprocess.DEVNULL)
            out = self.proc.stdout
        self._ready = threading.Event()

        def read() -> None:
            assert out is not None
            for line in out:
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


class _Forked:
    """A coordinator forked from the forkserver, with the surface of ``subprocess.Popen`` this module uses."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], netns: str | None) -> None:
        from torchnext.testing.multiprocess import Child, _mp_context

        mine, theirs = socket.socketpair()
        ctx = _mp_context("forkserver")
        self._p = Child(ctx, target=_serve, args=(list(argv), env, netns, theirs), name="coordinator", daemon=True)
        self._p.start()
        theirs.close()
        self._sock = mine
        self.stdout: IO[str] = mine.makefile("r", encoding="utf-8", errors="replace")

    @property
    def pid(self) -> int:
        return int(self._p.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired("forked coordinator", timeout or 0.0)
        self._sock.close()
        return int(self._p.exitcode)

    def kill(self) -> None:
        self._p.kill()

    def terminate(self) -> None:
        self._p.terminate()


def _serve(argv: list[str], env: dict[str, str], netns: str | None, out: socket.socket) -> None:
    """The forked child: enter ``netns``, send stdout and stderr to ``out``, run ``torchnext <argv>`` (``argv[0]``
    is ``coordinator``), exit with its code (``os._exit``: nothing of the forkserver's state runs at exit)."""
    code = 1
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        out.close()
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # the process's own stdout, line-buffered
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.update(env)
        if netns is not None:
            from torchnext.testing.netns import enter

            enter(netns)
        import argparse

        from torchnext.ft import coordinator as command  # what `torchnext coordinator` runs (testing sits below cli)

        if argv[:1] != ["coordinator"]:
            raise ValueError(f"a forked coordinator runs `torchnext coordinator ...`, got {argv[:1]}")
        parser = argparse.ArgumentParser(prog="torchnext coordinator")
        command.add_arguments(parser)
        code = int(command.run(parser.parse_args(argv[1:])) or 0)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # report anything, then exit non-zero
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
