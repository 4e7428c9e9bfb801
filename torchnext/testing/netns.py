"""Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge, with link faults.

::

    with NetLab(4) as lab:                        # hosts 0..3: namespaces, addresses lab.address(i) = 10.213.x.(i+1)
        proc = lab.popen(0, ["python", "-m", "torchnext", "coordinator", "--host", lab.address(0)])
        lab.isolate([3])                          # host 3's link goes down: its packets vanish (no RST, no error)
        lab.partition([[0, 1], [2, 3]])           # two islands: each side reaches only its own hosts
        lab.heal()                                # one network again

Layout: a namespace ``<name>-br`` holds a Linux bridge per island (``br0`` is the whole network); host ``i`` is the
namespace ``<name>-h<i>`` whose ``eth0`` (address ``10.213.<net>.<i+1>/24``) is one end of a veth pair; the other
end sits in ``<name>-br`` as a port of a bridge. Faults act on those bridge ports only: ``isolate`` sets them down
(the host's ``eth0`` keeps its address and routes and loses its carrier, so traffic is silently dropped -- what a
pulled cable looks like), ``partition`` moves each island's ports to a bridge of its own. Nothing is added to the
root namespace: each veth pair is created with its ends already in the two namespaces, so deleting the namespaces
deletes everything.

Everything the lab creates carries its unique name (``torchnext-<pid>-<random>``) and is removed by ``close()``,
which ``with``, ``atexit`` and a failing constructor all call; processes started with :meth:`popen` are killed and
reaped first. A lab also removes leftovers of earlier runs whose creating process is gone (a ``kill -9`` of a test
run). Needs root (CAP_NET_ADMIN) and the ``ip`` tool: :func:`available` says whether, and why not.

Processes of the lab's hosts: :meth:`popen` (``ip netns exec``), or :func:`enter` in a freshly forked child
(``setns(2)``; :class:`~torchnext.testing.ft_workload.WorkerSpec` ``netns=`` does it for FT members).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["NetLab", "available", "enter", "remove_leftovers"]

PREFIX = "torchnext-"
_CLONE_NEWNET = 0x40000000
_lock = threading.Lock()
_net_counter = [0]


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def available() -> tuple[bool, str]:
    """``(True, "")`` when network namespaces with veth pairs can be made here; else ``(False, why)``."""
    if shutil.which("ip") is None:
        return False, "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_NET_ADMIN); running as uid " + str(os.geteuid())
    name = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return False, f"`ip netns add` failed: {made.stderr.strip()}"
        veth = _ip("-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return False, f"`ip link add ... type veth` failed: {veth.stderr.strip()}"
        bridge = _ip("-n", name, "link", "add", "probe2", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return False, f"`ip link add ... type bridge` failed: {bridge.stderr.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"`ip` did not run: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _ip("netns", "del", name, check=False)


def enter(netns: str) -> None:
    """Move the calling thread (call it first thing in a fresh child process) into network namespace ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces of labs whose creating process is gone (names ``torchnext-<pid>-...``); returns them.
    Deleting a namespace deletes the veth ends and bridges inside it."""
    out = _ip("netns", "list", check=False)
    gone = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class NetLab:
    """``hosts`` network namespaces on one bridge (see the module docstring). ``address(i)``, ``netns(i)``,
    ``popen(i, argv)``, ``isolate(hosts)``, ``reconnect(hosts)``, ``partition(islands)``, ``heal()``,
    ``close()``."""

    def __init__(self, hosts: int, *, subnet: int | None = None) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 200:
            raise ValueError(f"NetLab: hosts must be an int in [1, 200], got {hosts!r}")
        ok, why = available()
        if not ok:
            raise RuntimeError(f"NetLab: network namespaces are not available: {why}")
        remove_leftovers()
        with _lock:
            _net_counter[0] += 1
            net = subnet if subnet is not None else (os.getpid() * 7 + _net_counter[0]) % 250 + 1
        if not 0 <= net <= 255:
            raise ValueError(f"NetLab: subnet must be in [0, 255], got {net}")
        self.hosts = hosts
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self._net = net
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._islands: list[list[int]] = [list(range(hosts))]
        self._down: set[int] = set()
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------- build
    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def netns(self, host: int) -> str:
        """The namespace of host ``host``."""
        self._check(host)
        return f"{self.name}-h{host}"

    def address(self, host: int) -> str:
        """Host ``host``'s address on the lab network (its ``eth0``)."""
        self._check(host)
        return f"10.213.{self._net}.{host + 1}"

    def _port(self, host: int) -> str:
        return f"port{host}"

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        br = self.bridge_ns
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for h in range(self.hosts):
            ns = self.netns(h)
            _ip("netns", "add", ns)
            self._made.append(ns)
            # the pair is born in the two namespaces: nothing of the lab ever sits in the root namespace
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self._port(h), "netns", br)
            _ip("-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", br, "link", "set", self._port(h), "master", "br0")
            _ip("-n", br, "link", "set", self._port(h), "up")

    def _check(self, host: int) -> None:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"NetLab: host must be in [0, {self.hosts}), got {host!r}")

    # -------------------------------------------------------------------------------------------- processes
    def popen(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``host`` (``ip netns exec``); killed and reaped by :meth:`close`."""
        p: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", self.netns(host), *argv], **kw)
        self._procs.append(p)
        return p

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program inside host ``host``."""
        return ["ip", "netns", "exec", self.netns(host)]

    # ------------------------------------------------------------------------------------------------ faults
    def isolate(self, hosts: Sequence[int]) -> None:
        """Take the links of ``hosts`` down: they reach nobody, nobody reaches them (packets are dropped)."""
        for h in hosts:
            self._check(h)
            _ip("-n", self.bridge_ns, "link", "set", self._port(h), "down")
            self._down.add(h)

    def reconnect(self, hosts: Sequence[int]) -> None:
        """Bring the links of ``hosts`` back up."""
        for h in hosts:
            self._check(h)
            _ip("-n", self.bridge_ns, "link", "set", self._port(h), "up")
            self._down.discard(h)

    def partition(self, islands: Sequence[Sequence[int]]) -> None:
        """Split the network: hosts of one island reach each other only. Hosts in no island are isolated."""
        seen = [h for isl in islands for h in isl]
        if len(set(seen)) != len(seen):
            raise ValueError(f"NetLab.partition: a host is in two islands: {islands}")
        for h in seen:
            self._check(h)
        br = self.bridge_ns
        for i, isl in enumerate(islands):
            bridge = f"br{i + 1}"
            if _ip("-n", br, "link", "show", bridge, check=False).returncode != 0:
                _ip("-n", br, "link", "add", bridge, "type", "bridge")
                _ip("-n", br, "link", "set", bridge, "up")
            for h in isl:
                _ip("-n", br, "link", "set", self._port(h), "master", bridge)
        self.isolate([h for h in range(self.hosts) if h not in seen])
        self._islands = [list(isl) for isl in islands]

    def heal(self) -> None:
        """One network again: every port on ``br0`` and up."""
        for h in range(self.hosts):
            _ip("-n", self.bridge_ns, "link", "set", self._port(h), "master", "br0")
        self.reconnect(list(range(self.hosts)))
        self._islands = [list(range(self.hosts))]

    # ---------------------------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Kill and reap the lab's processes, delete every namespace it made (and with them its links).
        Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            with contextlib.suppress(OSError):
                if p.poll() is None:
                    p.kill()
        for p in self._procs:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                p.wait(timeout=10)
        for ns in reversed(self._made):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _ip("netns", "del", ns, check=False)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (empty after :meth:`close`)."""
        out = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(self.name)]

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
