"""torchtitan jobs launched as a user launches them (``torchrun`` or ``torchnext run``), with bounded time and every
process reaped: the harness of torchnext's torchtitan tests.

Semantics of :func:`run_jobs`::

    for job in jobs (all at once):
        start  <launcher> --standalone --nproc-per-node N -m torchnext.testing.torchtitan_cpu --runs RUNS -m torchtitan.train COMMON
        (launcher: torchrun, or `torchnext run`: torchrun whose workers get torchnext process groups)
    wait for all, until timeout_s; past it: SIGTERM to each launcher, 10 s, then SIGKILL to it and every descendant
    return per job: exit code, wall seconds, the log, the backend each run's group got, and the processes left alive

``--standalone`` rendezvous on a free port of the loopback (torchrun's ``localhost:0``); each worker runs the
torchtitan jobs of ``runs`` one after the other in one process (:func:`torchnext.testing.torchtitan_cpu.main`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchnext.testing.procfs import stat_fields

__all__ = ["LAUNCHERS", "TitanJob", "TitanResult", "replica_group_env", "run_jobs", "worker_pids"]

LAUNCHERS: dict[str, list[str]] = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "torchnext": [sys.executable, "-m", "torchnext", "run"],
}
"""How each launcher is started: torch's ``torchrun``, and ``torchnext run`` (the same, torchnext groups)."""

_BACKEND_LINE = re.compile(r"torchtitan_cpu: run (\d+) rank (\d+) backend (\S+)")


@dataclass(kw_only=True)
class TitanJob:
    """One launch: ``nproc`` local ranks running ``runs`` (argument lists, each appended to ``common``)."""

    name: str
    """Names the log file (``<folder>/<name>.log``) and the job in errors."""
    launcher: str
    """A key of :data:`LAUNCHERS`."""
    runs: list[list[str]]
    common: list[str]
    nproc: int = 2
    env: dict[str, str] = field(default_factory=dict)
    """Added to this process's environment."""
    module: str = "torchtitan.train"
    launcher_args: list[str] = field(default_factory=list)
    """More launcher options (``["--max-restarts", "1"]``: torchrun restarts the job's workers when one dies)."""


@dataclass(kw_only=True)
class TitanResult:
    """What a job did."""

    job: TitanJob
    returncode: int | None
    """None: killed past the timeout."""
    wall_s: float
    log: str
    backends: dict[tuple[int, int], str]
    """``(run, rank) -> backend`` of the default process group, as each worker printed it."""
    leftover: list[int]
    """Descendant pids still alive (not zombies) after the job ended: should be empty."""

    def check(self) -> None:
        """Raise ``AssertionError`` naming the job and the log's tail unless it exited 0 and left nothing alive."""
        if self.returncode != 0 or self.leftover:
            tail = "\n".join(self.log.splitlines()[-60:])
            raise AssertionError(f"torchtitan job {self.job.name!r}: exit {self.returncode}, leftover processes "
                                 f"{self.leftover}, {self.wall_s:.0f} s; log tail:\n{tail}")


def replica_group_env(coordinator: str, token: str, group: int,
                      autotune_cache: Path | None = None) -> dict[str, str]:
    """The environment of one replica group's launch of a fault-tolerant torchtitan job on local CPU ranks: the
    coordinator's address and token, the group's index, Hugging Face offline (the tiny assets are local), and a
    shared autotune cache when given."""
    env = {"TORCHNEXT_FT_COORDINATOR": coordinator, "TORCHNEXT_FT_TOKEN": token,
           "TORCHNEXT_FT_REPLICA_GROUP": str(group), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    if autotune_cache is not None:
        env["TORCHNEXT_AUTOTUNE_CACHE"] = str(autotune_cache)
    return env


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _descendants(pid: int) -> set[int]:
    children, found, todo = _children_map(), set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _kill(pids: set[int], sig: signal.Signals) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def worker_pids(launcher_pid: int) -> list[int]:
    """The live worker processes under a launcher (``torchnext.testing.torchtitan_cpu`` in their command line)."""
    found = []
    for pid in sorted(_descendants(launcher_pid)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if b"torchnext.testing.torchtitan_cpu" in cmdline and b"torch.distributed.run" not in cmdline and _alive(pid):
            found.append(pid)
    return found


def run_jobs(jobs: Sequence[TitanJob], folder: Path, *, timeout_s: float,
             watch: Callable[[dict[str, int]], None] | None = None) -> list[TitanResult]:
    """Run ``jobs`` at once (see the module docstring); logs and run lists go to ``folder``. ``watch``, if given, is
    called about twice a second with ``{job name: launcher pid}`` while they run (a test's fault injector: it reads
    ``folder/<name>.log`` and kills what it wants, e.g. one of :func:`worker_pids`).

    Raises:
        ValueError: a job names an unknown launcher, or two jobs share a name.
    """
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"run_jobs: job names must differ, got {names}")
    started: list[tuple[TitanJob, subprocess.Popen[bytes], float, Path]] = []
    seen: dict[int, set[int]] = {}
    ended: dict[int, float] = {}
    try:
        for job in jobs:
            if job.launcher not in LAUNCHERS:
                raise ValueError(f"run_jobs: job {job.name!r}: unknown launcher {job.launcher!r}; "
                                 f"known: {sorted(LAUNCHERS)}")
            runs_file, log_path = folder / f"{job.name}.runs.json", folder / f"{job.name}.log"
            runs_file.write_text(json.dumps(job.runs))
            cmd = [*LAUNCHERS[job.launcher], "--standalone", "--nproc-per-node", str(job.nproc), *job.launcher_args,
                   "-m", "torchnext.testing.torchtitan_cpu", "--runs", str(runs_file), "-m", job.module, *job.common]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **job.env}, start_new_session=True)
            started.append((job, proc, time.monotonic(), log_path))
            seen[proc.pid] = set()
        deadline = time.monotonic() + timeout_s
        while len(ended) < len(started) and time.monotonic() < deadline:
            for _, proc, t0, _ in started:
                if proc.pid not in ended:
                    seen[proc.pid] |= _descendants(proc.pid)
                    if proc.poll() is not None:
                        ended[proc.pid] = time.monotonic() - t0
            if watch is not None:
                watch({job.name: proc.pid for job, proc, _, _ in started if proc.pid not in ended})
            time.sleep(0.5)
    finally:
        for _, proc, _, _ in started:
            if proc.poll() is None:
                seen[proc.pid] |= _descendants(proc.pid)
                proc.send_signal(signal.SIGTERM)  # torchrun's agent stops its workers
        for _, proc, _, _ in started:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill({proc.pid}, signal.SIGKILL)
                proc.wait(timeout=10)
            _kill({p for p in seen[proc.pid] if _alive(p)}, signal.SIGKILL)
    results = []
    for job, proc, t0, log_path in started:
        time_left = time.monotonic() + 10
        while any(_alive(p) for p in seen[proc.pid]) and time.monotonic() < time_left:
            time.sleep(0.1)
        text = log_path.read_text(errors="replace")
        backends = {(int(m[1]), int(m[2])): m[3] for m in _BACKEND_LINE.finditer(text)}
        results.append(TitanResult(job=job, returncode=proc.returncode if proc.pid in ended else None,
                                   wall_s=ended.get(proc.pid, time.monotonic() - t0), log=text, backends=backends,
                                   leftover=sorted(p for p in seen[proc.pid] if _alive(p))))
    return results
